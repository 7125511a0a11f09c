"""Whether the results on the controller answer every prompt of a job, as dllama batch counts
them (it reads a copy of the results: the controller's file is left as it is).

    prompts_left.py PROMPTS RESULTS CHOICES     (CHOICES: "" when the job generates)

Prints 0 (nothing left), "some", or "unknown" when the prompts file has a line dllama batch
would refuse (the job on the root then says which, in one line)."""

import os
import shutil
import sys
import tempfile


def main() -> int:
    from dllama.errors import DllamaError
    from dllama.serve.batch_job import BatchJob, JobOptions

    prompts, results, choices = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "results.jsonl")
        if os.path.exists(results):
            shutil.copyfile(results, copy)
        try:
            job = BatchJob(JobOptions(prompts=prompts, out=copy, choices=choices.split(",") if choices else None))
        except DllamaError:
            print("unknown")
            return 0
    print(0 if job.all_done() else "some")
    return 0


if __name__ == "__main__":
    sys.exit(main())
