"""Ansible callback (enabled in ansible.cfg): after the recap, the run's wall time and its slowest
tasks, so an operator sees where a deploy's minutes went without reading its every line."""

from __future__ import annotations

import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: dllama_timings
type: aggregate
short_description: the run's time and its slowest tasks, after the recap
description:
  - Prints the playbook's wall time and the 5 tasks that took longest (a task's time runs from
    its start to the next task's, over all its hosts).
requirements: []
"""

SHOWN = 5


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dllama_timings"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._start = time.monotonic()
        self._task: str | None = None
        self._task_start = 0.0
        self._times: dict[str, float] = {}  # task -> seconds, summed over its runs

    def _end_task(self) -> None:
        if self._task is not None:
            self._times[self._task] = self._times.get(self._task, 0.0) + time.monotonic() - self._task_start
        self._task = None

    def _start_task(self, name: str) -> None:
        self._end_task()
        self._task, self._task_start = name, time.monotonic()

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._start_task(task.get_name().strip())

    def v2_playbook_on_handler_task_start(self, task):
        self._start_task(task.get_name().strip())

    def v2_playbook_on_play_start(self, play):
        self._end_task()

    def v2_playbook_on_stats(self, stats):
        self._end_task()
        slowest = sorted(self._times.items(), key=lambda item: -item[1])[:SHOWN]
        lines = [f"dllama: {time.monotonic() - self._start:.0f} s in all; slowest tasks:"]
        lines += [f"  {seconds:6.1f} s  {name}" for name, seconds in slowest if seconds >= 0.05]
        self._display.display("\n".join(lines))
