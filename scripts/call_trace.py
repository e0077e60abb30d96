"""The Python calls of one training step, as a new maintainer would follow them.

Trains the demo config (DeepFM, synthetic rows) in this process for a few steps
with a profile hook on recflow's own code. A step is what happens between two
resumptions of the runner's report generator (`LocalRunner.reports`): the
runner takes a batch and runs the traced train step, yields its report, and the
loop (`Trainer.train_on`) counts it, draws the bar and runs the callbacks.

Reported for a plain step and for a step that writes a checkpoint (lifecycle
rebuild included):

    calls        recflow functions called during the step
    files        distinct recflow files those calls live in (target: at most 12)
    call-backs   calls into an object that is already up the call stack behind
                 another object (A calls B, B calls back into A); target: none

Usage:
    python scripts/call_trace.py            # table, then the JSON line
    python scripts/call_trace.py --calls    # also every call, indented by depth

Last line: {"bench": "call_trace", "steps": [{"step":.., "calls":.., "files": [..], ...}]}
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

PLAIN, CHECKPOINT = 5, 6  # checkpoint_every_steps = CHECKPOINT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", action="store_true", help="print every call of the traced steps")
    return p.parse_args(argv)


class StepTracer:
    """A `sys.setprofile` hook that splits recflow's calls into steps."""

    def __init__(self, package_dir: str):
        self.package_dir = package_dir
        self.steps: list[list[tuple[int, str, str, bool]]] = []  # (depth, file, function, call-back)
        self.stack: list = []  # (frame, self object or None) of the recflow frames in progress

    def _ours(self, frame) -> bool:
        return frame.f_code.co_filename.startswith(self.package_dir)

    def __call__(self, frame, event, arg):
        if event == "call" and self._ours(frame):
            code = frame.f_code
            if code.co_name == "reports" and code.co_filename.endswith("training/runner.py"):
                self.steps.append([])  # the runner resumes: a new step begins
            owner = frame.f_locals.get("self") if code.co_argcount else None
            callback = owner is not None and _calls_back(self.stack, owner)
            if self.steps:
                name = getattr(code, "co_qualname", code.co_name)
                path = os.path.relpath(code.co_filename, os.path.dirname(self.package_dir))
                self.steps[-1].append((len(self.stack), path, name, callback))
            self.stack.append((frame, owner))
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()


def _calls_back(stack, owner) -> bool:
    """Whether `owner` is up the stack with another object's frame between it and the top."""
    others = False
    for _, up in reversed(stack):
        if up is owner:
            return others
        if up is not None:
            others = True
    return False


def main(argv=None) -> int:
    args = parse_args(argv)
    import recflow

    package_dir = os.path.dirname(os.path.abspath(recflow.__file__))
    tracer = StepTracer(package_dir)
    overrides = {
        "data.synthetic.rows": 4096, "data.synthetic.eval_rows": 512, "data.batch_size": 256,
        "train.epochs": None, "train.steps": CHECKPOINT + 1, "train.checkpoint_every_steps": CHECKPOINT,
        "export.at_end": False,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        sys.setprofile(tracer)
        try:
            recflow.train(os.path.join(common.REPO, "configs", "deepfm_demo.yaml"),
                          model_dir=os.path.join(work, "run"), overrides=overrides)
        finally:
            sys.setprofile(None)
    results = []
    for label, step in (("plain step", PLAIN), ("checkpoint step", CHECKPOINT)):
        calls = tracer.steps[step - 1]  # steps[i]: the calls after the runner's i-th resumption
        files = sorted({path for _, path, _, _ in calls})
        backs = [f"{path}:{name}" for _, path, name, back in calls if back]
        results.append({"label": label, "step": step, "calls": len(calls), "files": files,
                        "call_backs": backs})  # fmt: skip
        if args.calls:
            print(f"\n{label} (step {step}):")
            for depth, path, name, back in calls:
                print(f"{'  ' * depth}{path}:{name}{'   <- calls back' if back else ''}")
    common.print_table(
        ["step", "calls", "files", "call-backs"],
        [[f"{r['label']} ({r['step']})", r["calls"], len(r["files"]), len(r["call_backs"])] for r in results],
    )
    for r in results:
        print(f"\n{r['label']}: " + ", ".join(r["files"]))
    common.emit_json("call_trace", steps=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
