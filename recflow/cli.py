"""recflow: train, evaluate, export and serve sparse recommendation models from a YAML config.

Configs and data headers are validated before TensorFlow is imported, so a
user mistake costs no wait and prints one line: `recflow: <what>` (exit 2).
TensorFlow's import-time lines on stderr (cuFFT/cuDNN/cuBLAS factories) are
hidden unless RECFLOW_DEBUG=1.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import gc
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import traceback
from typing import NoReturn

from recflow.errors import ConfigError, RecflowError, one_line, op_reason
from recflow.layout import Layout


class _Parser(argparse.ArgumentParser):
    """Bad arguments print one line, `recflow: ...`, like every user error (exit 2)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        where = f"{command}: " if command else ""
        self.exit(2, f"recflow: {where}{one_line(message)} (see `{self.prog} --help`)\n")


def import_tensorflow() -> None:
    """Imports TensorFlow with its import-time lines on stderr hidden (see `recflow.quiet`),
    and its Python warnings (e.g. tf.function retracing notes) below errors: the CLI owns
    the screen. RECFLOW_DEBUG=1 shows everything.

    pandas stays out of the import when nothing has loaded it yet: tf_keras imports it
    only to accept DataFrames in `Model.fit`, which recflow never calls, and it cost
    0.25-0.3 CPU s of every command's start (measured on 2 cores). A later
    `import pandas` works as usual.

    Python's cyclic garbage collector is off while TensorFlow and tf_keras import, and
    the objects they leave (about 330,000, of which some 3,000 are garbage) are then
    frozen out of its view (`gc.freeze`). Each full collection walks every object the
    process holds: the import alone ran five of them, and one more came while the first
    step traced, 0.4 s in all of a 9.6 s training job (plus 0.12 s of younger ones);
    frozen, the job's collections took 0.05 s. The CLI owns its process: the library
    (`recflow.api`) leaves the collector as its caller set it."""
    if "tensorflow" in sys.modules:
        return
    from recflow.quiet import native_stderr_silenced

    keep_out = "pandas" not in sys.modules
    if keep_out:
        sys.modules["pandas"] = None  # `import pandas` raises ImportError: tf_keras goes without
    _use_standard_distutils()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with native_stderr_silenced():
            import tensorflow as tf
            import tf_keras  # noqa: F401  (recflow's models use it: frozen with TF)
    finally:
        if collecting:
            gc.enable()
        if keep_out:
            del sys.modules["pandas"]
    gc.freeze()
    if not os.environ.get("RECFLOW_DEBUG"):
        tf.get_logger().setLevel(logging.ERROR)


def _use_standard_distutils() -> None:
    """`import distutils` gives the standard library's package, not setuptools' copy.

    TensorFlow imports distutils at its start (its plugin directories, `tf.lite`'s
    `distutils.spawn`). Where setuptools' `.pth` shim serves that import (Python 3.11
    and older with setuptools installed: a venv's default), it loads setuptools and
    pkg_resources first: 0.12 s of every command's start, measured here, for modules
    recflow never uses. Python 3.12 has no distutils of its own: the shim stays."""
    if sys.version_info >= (3, 12) or "distutils" in sys.modules:
        return
    try:
        import _distutils_hack
    except ImportError:  # no setuptools shim
        return
    _distutils_hack.remove_shim()


def _parser() -> argparse.ArgumentParser:
    import recflow
    from recflow.config.reference import describe  # the config keys' descriptions
    from recflow.config.schema import SyntheticOptions, TrainConfig

    parser = _Parser(prog="recflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"recflow {recflow.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("config", help="YAML config file")
        p.add_argument("--model-dir", help="overrides train.model_dir, " + describe(TrainConfig, "model_dir"))
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a config value (YAML), e.g. --set train.steps=100",
        )
        return p

    p = with_config("train", "train (resuming from the latest checkpoint), evaluate, export")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--follow", action="store_true",
        help="online learning: train on each new file of data.train as it appears, until SIGTERM/Ctrl-C",
    )
    p.add_argument("--poll-seconds", type=float, default=1.0, help="with --follow: idle poll interval (positive)")
    p.add_argument(
        "--status-seconds", type=float, default=10.0,
        help="streams (--follow, data.format kafka): print the rate and lag at most this often (positive)",
    )
    p.add_argument(
        "--warm-start", metavar="FROM_DIR",
        help="start a new model dir from FROM_DIR's rows and weights wherever they still fit "
        "(same table and dim, same dense shapes): how to add or remove a feature",
    )
    with_config("evaluate", "evaluate the latest checkpoint; writes metrics.json")
    p = with_config("export", "write a new SavedModel version (or a delta) from the latest checkpoint")
    p.add_argument("--delta", action="store_true", help="write deltas/<step>/ instead")
    p = with_config("plan", "print the fused-table plan, shard placement and memory estimate")
    p.add_argument("--ps", type=int, default=1, help="parameter servers to place shards on")
    p.add_argument("--keys", type=int, default=1_000_000, help="keys per logical table for the estimate")

    p = with_config("launch", "start a local multi-process PS cluster on loopback and train on it")
    p.add_argument("--ps", type=int, required=True, help="parameter-server tasks")
    p.add_argument("--workers", type=int, required=True, help="worker tasks")

    p = sub.add_parser(
        "predict",
        help="score a CSV/Parquet file with an export (read with the training CSV settings); "
        "one line per row, every output (a header line when there are several)",
    )
    p.add_argument("export_dir")
    p.add_argument("data_file")
    p.add_argument("--batch-size", type=int, default=4096, help="rows scored at a time (a positive integer)")

    p = sub.add_parser(
        "serve", help="TF Serving REST API over the newest export, applying new deltas in place"
    )
    p.add_argument("model_dir", help="the model dir to serve (and follow)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (loopback by default)")
    p.add_argument("--model-name", help="the name in URLs (default: the model dir's folder name)")
    p = sub.add_parser("tables", help="per logical table: keys, bytes, keys per shard")
    p.add_argument("model_dir")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot", metavar="OUT.png",
        help="also draw keys and bytes per table over the model dir's checkpoints (needs matplotlib)",
    )

    p = sub.add_parser("data", help="data helpers")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    p = data_sub.add_parser(
        "check", help="one pass over the training data, no training: parse failures, "
        "empty rates, distinct ids, number ranges, label values, what a run would refuse"
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("--rows", type=int, default=None, help="read only the first N rows")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value (YAML), e.g. --set data.train=day1.csv",
    )
    p = data_sub.add_parser("synth", help="write the synthetic data set")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, required=True, help="training rows (and a fifth as many eval rows)")
    p.add_argument("--format", choices=["csv", "tfrecord", "parquet"], default="csv")
    p.add_argument(
        "--schema", choices=["demo", "criteo", "sequence"], default="demo",
        help=describe(SyntheticOptions, "schema"),
    )
    p.add_argument("--seed", type=int, default=7, help=describe(SyntheticOptions, "seed"))
    return parser


_context: dict = {}  # what an error without a path can name: "model_dir", "config"


def _load(args, check_data: bool = True, tensorflow: bool = True):
    """The validated config of `args`, its data sources checked when `check_data`;
    then TensorFlow is imported, unless the command runs none itself (not `tensorflow`)."""
    from recflow.config import load_config
    from recflow.data import check_sources

    overrides = list(args.set)
    if args.model_dir:
        overrides.append(f"train.model_dir={json.dumps(args.model_dir)}")
    # plan and export read no data: data.train may be left out
    config = load_config(args.config, overrides, needs_data=args.command not in ("plan", "export"))
    _context["model_dir"] = config.train.model_dir
    _context["config"] = config
    if check_data:
        check_sources(config)
    if config.data.format == "kafka" and args.command == "train":
        from recflow.data.kafka import KafkaSource

        KafkaSource(config, {}).check()  # a broker that is down costs no TensorFlow start-up
    if tensorflow:
        import_tensorflow()
    return config


def _number(value) -> str:
    """A metric for the summary line: 4 decimals, or 4 significant digits under 0.01 (an mse
    of 4.04e-05 is not `0.0000`); an undefined one (None, NaN) prints as n/a."""
    if value is None or value != value:
        return "n/a"
    return f"{value:.4g}" if 0 < abs(value) < 0.01 else f"{value:.4f}"


def _format_metrics(result: dict) -> str:
    """The summary line: every metric the heads computed (`eval_metrics`), then the counts."""
    parts = [f"{k} {_number(result[k])}" for k in result.get("eval_metrics", ()) if k in result]
    if "oracle_auc" in result:
        parts.append(f"(oracle auc {_number(result['oracle_auc'])})")
    if "examples_per_sec" in result:
        parts.append(f"{result['examples_per_sec']:.0f} examples/s")
    parts.append(f"step {result.get('steps')}")
    if "bad_records" in result or "eval_bad_records" not in result:
        parts.append(f"bad_records {result.get('bad_records', 0)}")  # the training's
    if result.get("eval_bad_records") or ("eval_bad_records" in result and "bad_records" not in result):
        parts.append(f"eval_bad_records {result['eval_bad_records']}")  # `recflow evaluate`: always
    for key, label in (("nonfinite_values", "non-finite values"), ("truncated_rows", "truncated rows")):
        if result.get(key):
            parts.append(f"{label} {result[key]}")
    return "  ".join(parts)


def cmd_train(args) -> int:
    from recflow import api

    for option, value in (("--poll-seconds", args.poll_seconds), ("--status-seconds", args.status_seconds)):
        if not 0 < value < math.inf:  # before the config loads; NaN fails too
            raise RecflowError(f"{option}: expected a positive number of seconds, got {value:g}")
    # A stream may start before its first file: with --follow, files are checked as they come.
    config = _load(args, check_data=not args.follow, tensorflow=False)
    if api.is_chief(config):  # a PS or worker task runs TF's server alone (`cluster.serve`)
        import_tensorflow()
    else:  # ... and waits in its C++ join, where no Python handler runs: SIGTERM ends it as is
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.warm_start and not os.path.isdir(args.warm_start):
        raise RecflowError(f"--warm-start {args.warm_start}: no such model dir")
    stream = args.follow or config.data.format == "kafka"
    verbose = 0 if (args.quiet or stream) else 1

    def report(file, examples, step):
        print(f"trained {file}: {examples} examples, step {step}", flush=True)

    result = api.train(
        config,
        verbose=verbose,
        warm_start=args.warm_start,
        follow=args.follow,
        poll_seconds=args.poll_seconds,
        on_file=report,
        status_every=None if args.quiet else args.status_seconds,
    )
    model_dir = config.train.model_dir
    if result.get("stopped"):  # the normal end of a Kafka stream: exit 0
        print(f"stopped at step {result['steps']} ({result['stopped']}); offsets {result['kafka_offsets']}")
    if result.get("interrupted"):
        print(
            f"stopped at step {result['steps']} (interrupted by {result['interrupted']}); "
            f"checkpoint in {os.path.join(model_dir, 'checkpoints')}: rerun the same command to resume"
        )
        return 128 + signal.Signals[result["interrupted"]].value
    if result.get("already_done"):
        goal = f"train.steps={config.train.steps}" if config.train.steps else f"train.epochs={config.train.total_epochs}"
        print(
            f"{model_dir} is already at step {result['steps']} ({goal}): nothing to train, "
            "no new export (`recflow export` writes one; raise train.steps/epochs to train on)"
        )
        return 0
    if "warm_start" in result and not verbose:
        from recflow.training.warm_start import describe

        print(describe(result["warm_start"]))
    print(_format_metrics(result))
    print(f"model dir: {model_dir}   export: {result.get('export', 'none (export.at_end: false)')}")
    return 0


def cmd_launch(args) -> int:
    from recflow.distribute.launcher import Cluster

    # Validated once here, before any process starts. The launcher itself runs no
    # TensorFlow: importing it would only delay every task's start (~2 s).
    config = _load(args, tensorflow=False)
    train_args = [args.config, "--model-dir", config.train.model_dir]
    for item in args.set:
        train_args += ["--set", item]
    cluster = Cluster(train_args, config.train.model_dir, args.ps, args.workers)
    code = cluster.run()
    if code in (130, 143):  # stopped by SIGINT or SIGTERM: the chief said at which step
        return code
    if code != 0:
        raise RecflowError(f"launch: the chief exited with {code}; see {config.train.model_dir}/logs/chief-0.log")
    with open(Layout(config.train.model_dir).metrics_path, encoding="utf-8") as f:
        metrics = json.load(f)
    print(_format_metrics(metrics))
    print(f"model dir: {config.train.model_dir}   export: {metrics.get('export', 'none (export.at_end: false)')}")
    return 0


def cmd_evaluate(args) -> int:
    from recflow.api import evaluate

    config = _load(args)
    print(_format_metrics(evaluate(config)))
    return 0


def cmd_export(args) -> int:
    from recflow.api import export

    config = _load(args, check_data=False)
    print(export(config, delta=args.delta))
    return 0


def cmd_predict(args) -> int:
    if args.batch_size <= 0:  # before the import below, which loads TensorFlow
        raise RecflowError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    import_tensorflow()
    from recflow.exporter.predict import predict_file

    for line in predict_file(args.export_dir, args.data_file, args.batch_size):
        print(line)
    return 0


def cmd_plan(args) -> int:
    config = _load(args, check_data=False)  # before the import below, which loads TensorFlow
    if args.ps < 1 or args.keys < 1:
        raise RecflowError("plan: --ps and --keys must be positive integers")
    from recflow.embedding.report import format_plan
    from recflow.models.registry import get_model_class

    first_order = get_model_class(config.model.type).first_order
    print(format_plan(config, first_order, keys_per_table=args.keys, num_shards=args.ps))
    return 0


def cmd_serve(args) -> int:
    if not 0 <= args.port < 65536:
        raise RecflowError(f"--port: expected 0..65535, got {args.port}")
    if not os.path.isdir(args.model_dir):
        raise RecflowError(f"{args.model_dir}: no such model dir")
    import_tensorflow()
    from recflow.serve import run_server

    handler = logging.StreamHandler()  # the server's own log: timestamped lines on stderr
    handler.setFormatter(logging.Formatter("%(asctime)s recflow serve %(levelname)s %(message)s"))
    serve_logger = logging.getLogger("recflow.serve")
    serve_logger.addHandler(handler)
    serve_logger.setLevel(logging.INFO)
    serve_logger.propagate = False
    run_server(args.model_dir, args.host, args.port, args.model_name)
    return 0


def cmd_tables(args) -> int:
    from recflow.embedding.plot import plot_history, require_matplotlib

    if args.plot:
        require_matplotlib()  # before TensorFlow loads
    import_tensorflow()
    from recflow.embedding.report import format_tables
    from recflow.training.tables import table_history, table_stats

    _check_newest_checkpoint(args.model_dir)
    stats = table_stats(args.model_dir)
    print(json.dumps({"tables": stats}, sort_keys=True) if args.json else format_tables(stats))
    if args.plot:
        history = table_history(args.model_dir)
        plot_history(history, args.plot, title=args.model_dir)
        steps = f"steps {history[0][0]}-{history[-1][0]}" if len(history) > 1 else f"step {history[0][0]}"
        if not args.json:  # stdout stays one JSON document
            print(f"{args.plot}: keys and bytes over {len(history)} checkpoint(s), {steps}")
    return 0


def _check_newest_checkpoint(model_dir: str) -> None:
    """A reader's check: the checkpoint the index names must read back whole.

    Readers repair nothing (the next writer does): a damaged one is a one-line error.
    """
    import tensorflow as tf

    from recflow.training import checkpoints as checkpoint_lib

    checkpoints = Layout(model_dir).checkpoint_dir
    newest = tf.train.latest_checkpoint(checkpoints)
    if newest is None and checkpoint_lib.checkpoint_steps(checkpoints):
        raise RecflowError(
            f"{checkpoints}/checkpoint: unreadable or missing index beside ckpt-* files; "
            "the next train, evaluate or export rebuilds it"
        )
    problem = checkpoint_lib.verify_checkpoint(newest) if newest else None
    if problem is not None:
        files = ", ".join(checkpoint_lib.checkpoint_files(newest))
        raise RecflowError(
            f"{files}: damaged checkpoint ({problem}); the next train, evaluate or export "
            "falls back to the newest readable one"
        )


def cmd_data(args) -> int:
    if args.data_command == "check":
        return cmd_data_check(args)
    if args.rows <= 0:  # before the import below, which loads TensorFlow
        raise RecflowError(f"--rows: expected a positive integer, got {args.rows}")
    import_tensorflow()
    from recflow.data.writer import write_synthetic

    for path in write_synthetic(args.out, args.rows, args.format, schema=args.schema, seed=args.seed):
        print(path)
    return 0


def cmd_data_check(args) -> int:
    from recflow.config import load_config
    from recflow.data.check import check, format_report

    if args.rows is not None and args.rows <= 0:
        raise RecflowError(f"--rows: expected a positive integer, got {args.rows}")
    report = check(load_config(args.config, args.set), args.rows)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["problems"]:
        raise RecflowError(
            f"data check: {len(report['problems'])} problem(s) would stop `recflow train`: "
            + report["problems"][0]
        )
    return 0


_COMMANDS = {
    "serve": cmd_serve,
    "train": cmd_train,
    "evaluate": cmd_evaluate,
    "export": cmd_export,
    "launch": cmd_launch,
    "predict": cmd_predict,
    "plan": cmd_plan,
    "tables": cmd_tables,
    "data": cmd_data,
}


_TF_PATH = re.compile(r"(/[^\s;'\"]+|[\w.-]+/[^\s;'\"]+)")


def _path_in(text: str) -> str | None:
    """The first file path in a TF error message (TF errors carry no `filename`)."""
    text = re.sub(r"\{\{.*?\}\}", "", text)  # {{function_node ...device:CPU:0}}
    match = _TF_PATH.search(text)
    return _shown_path(match.group(1).rstrip(".,")) if match else None


def _shown_path(path: str) -> str:
    """A staging path (removed by now) shown as what it stood for: `ckpt-N_temp/...`
    as `ckpt-N`, `export/.tmp-x/...` as `export`."""
    path = re.sub(r"_temp/.*$", "", path)
    return re.sub(r"/\.tmp-[^/]*(/.*)?$", "", path)


def _environment_error(exc: BaseException) -> str | None:
    """A full disk, a file that vanished, a damaged file: one line naming the path."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = _shown_path(str(exc.filename)) if exc.filename else _context.get("model_dir", "the model dir")
        return f"{where}: no space left on device (nothing half-written is kept; free space and rerun)"
    if isinstance(exc, PermissionError) and exc.filename:
        return f"{_shown_path(str(exc.filename))}: permission denied"
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"{exc.filename}: no such file (removed while recflow ran?)"
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    if not isinstance(exc, tf.errors.OpError):
        return None
    text = exc.message or ""
    path = _path_in(text) or "?"
    if isinstance(exc, tf.errors.ResourceExhaustedError) and "space left" in text:
        return f"{path}: no space left on device (nothing half-written is kept; free space and rerun)"
    if isinstance(exc, tf.errors.NotFoundError) and "No such file" in text:
        return f"{path}: no such file (removed while recflow ran?)"
    if isinstance(exc, tf.errors.DataLossError):
        where = path if path != "?" else _truncated_record() or "a data file"
        return f"{where}: damaged file ({op_reason(text)[:160]})"
    return None


def _truncated_record() -> str | None:
    """The first truncated record of the command's TFRecord files (TensorFlow's message
    names no file), or None."""
    config = _context.get("config")
    if config is None or config.data.format != "tfrecord":
        return None
    from recflow.data import sources, tfrecord

    try:  # while reporting another error: a file gone since is no reason to raise
        return tfrecord.first_truncated(sources.expand([*config.data.train, *config.data.eval], "data"))
    except (RecflowError, OSError):
        return None


_LISTS = {"string": "a bytes_list", "int64": "an int64_list", "float": "a float_list"}
_MIXED_LISTS = re.compile(r"Key: (.+?), Index: \d+\.\s+Data types don't match\. Expected type: (\w+), Actual type: (\w+)")


def _user_error(exc: BaseException) -> str | None:
    """The one-line message of a user mistake, or None for a bug."""
    if isinstance(exc, RecflowError):
        return str(exc)
    message = _environment_error(exc)
    if message is not None:
        return message
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        if isinstance(exc, tf.errors.InvalidArgumentError):
            from recflow.data import bad_record_message

            mixed = _MIXED_LISTS.search(exc.message or "")
            if mixed:  # parse_example fails a whole batch: no record to name
                column, expected, got = mixed.groups()
                return (f"a TFRecord record stores column '{column}' as {_LISTS.get(got, got)}, where the "
                        f"first record of the first file has {_LISTS.get(expected, expected)}: store each "
                        "column as one list type in every record")
            return bad_record_message(exc)
    return None


@contextlib.contextmanager
def _log_warnings():
    """recflow's library warnings print as `recflow: warning: ...` lines on stderr, once:
    while the command runs they do not also reach the root logger's handlers (absl
    installs one when TensorFlow first logs, and would print each warning again)."""

    class Stderr(logging.Handler):  # the current sys.stderr at each message
        def emit(self, record: logging.LogRecord) -> None:
            print(f"recflow: warning: {one_line(record.getMessage())}", file=sys.stderr)

    logger = logging.getLogger("recflow")
    if not any(type(h).__name__ == "Stderr" for h in logger.handlers):
        handler = Stderr()
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import recflow  # noqa: F401  (selects Keras 2 before TensorFlow loads)

    with _log_warnings():
        return _run_command(argv)


class _Terminated(KeyboardInterrupt):
    """SIGTERM outside training's steps (which stop on it after the current step, see
    `Trainer.signals_stop`): the command stops as on Ctrl-C, and exits 143."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises `_Terminated` in the block, as SIGINT raises KeyboardInterrupt: what
    is staged is removed on the way out (or left for the next writer), never half-shown.
    Only in the main thread (Python delivers signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_command(argv: list[str] | None) -> int:
    try:
        with _sigterm_interrupts():
            parser = _parser()
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:  # argparse already printed its message
                return int(e.code or 0)
            return _run(args)
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, _Terminated)
        print("recflow: interrupted" + (" by SIGTERM" if terminated else ""), file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


def _run(args) -> int:
    """Runs the parsed command; a user error prints one line (exit 2), a bug its traceback (1)."""
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:  # `recflow predict ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - the CLI owns the exit code
        if isinstance(exc, ConfigError) and exc.file is None and getattr(args, "config", None):
            exc = exc.with_file(args.config)  # found after loading: the model's params, the heads
        message = _user_error(exc)
        if os.environ.get("RECFLOW_DEBUG"):
            traceback.print_exc()
        if message is not None:
            print(f"recflow: {one_line(message)}", file=sys.stderr)
            return 2
        if not os.environ.get("RECFLOW_DEBUG"):
            traceback.print_exc()
        print(f"recflow: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def run() -> None:
    """The console entry point: `main()`, then, when it succeeded, exit without the
    interpreter's teardown (with TensorFlow loaded it takes ~0.8 s). Every file is
    written and closed by then; the output is flushed here.

    The exit functions still run (under a millisecond): logging's shutdown, and
    AutoGraph's removal of the modules it generated into the temp dir (each converted
    function is a `__autograph_generated_file*.py` there; skipped, a run left five)."""
    code = main()
    if code == 0:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:  # the reader is gone; nothing is left to write
            pass
        atexit._run_exitfuncs()  # what `sys.exit` runs before the teardown os._exit skips
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    run()
