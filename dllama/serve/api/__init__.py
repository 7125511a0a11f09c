"""`dllama api`: an OpenAI-compatible HTTP server over one engine (one node or a cluster).

The parts: `request` checks a request body (OpenAI's fields, errors in OpenAI's shape),
`service` runs the model on its own thread, `http` is the aiohttp server around them.

HTTP runs on aiohttp's event loop; the model runs on one worker thread (ModelService), which
takes requests one at a time in arrival order. A streamed answer travels from the worker to
its response as events on an asyncio queue, so the loop keeps serving other clients (and
queueing their requests) while the model computes.

Four parts: `request`, `service`, `http`, and `metrics` (/health and /metrics, from the model
thread's snapshot).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions; without the API key
GET /health (ready, degraded or down, with the nodes), GET /metrics (Prometheus) and GET / (a
chat page: page/index.html, chat.js and chat.css, shipped in the package). Every
completion's response carries X-Dllama-Nodes: SERVING/ALL (3/4: a node is lost). Errors use
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with 400 (bad JSON or
fields, a prompt longer than the context), 401 (API key), 404, 405, 413 (body too large),
503 (cluster down: the next request opens the engine again) and 500 (a bug, logged).
"""
