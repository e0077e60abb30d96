"""What tests/test_procs.py runs in a zygote's child and in a fresh python, to compare
them: `child_probe.py ACTION [ARGS...]`."""

import os
import sys
import time


def main(action: str) -> None:
    if action == "show":  # what the child was started with
        print(sys.argv, os.getcwd(), os.environ.get("RECFLOW_PROBE"), sys.path[0], __name__)
    elif action == "exit":
        sys.exit(int(sys.argv[2]))
    elif action == "exit-message":
        sys.exit("a message")
    elif action == "raise":
        raise ValueError("boom")
    elif action == "stdin":
        print(sys.stdin.read().upper())
    elif action == "sleep":  # says it is up, then waits to be signalled
        print("up", flush=True)
        time.sleep(60)
    elif action == "session":  # runs until its stdin closes
        print(os.getsid(0) == os.getpid())
        print("to err", file=sys.stderr)
        sys.stdin.read()
    elif action == "unflushed":  # one line left in the buffer unless PYTHONUNBUFFERED
        print("now")
        time.sleep(60)
    elif action == "modules":
        print("tensorflow" in sys.modules)


if __name__ == "__main__":
    main(sys.argv[1])
