"""The Python API: train, evaluate and export from a notebook or a script.

    >>> import recflow
    >>> metrics = recflow.train("configs/deepfm_demo.yaml", model_dir="runs/nb",
    ...                         overrides={"train.epochs": 1}, callbacks=[MyCallback()])
    >>> recflow.evaluate("configs/deepfm_demo.yaml", model_dir="runs/nb")["auc"]
    >>> recflow.export("configs/deepfm_demo.yaml", model_dir="runs/nb")   # the export dir

Each call does what the matching `recflow` command does (the same model-dir
lock, checks and files) and returns its result instead of printing it. Under
`distribute.strategy: parameter_server` the process must be the chief of its
TF_CONFIG cluster (`recflow launch` runs the other tasks).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

from recflow.config.schema import Config
from recflow.errors import RecflowError


def load(config_or_path, model_dir: str | None = None, overrides=None, needs_data: bool = True) -> Config:
    """A validated config from a YAML path or a `Config`, with overrides and the model dir.

    Args:
        config_or_path: a config file path or a `recflow.Config`.
        model_dir: overrides `train.model_dir`.
        overrides: `{"train.steps": 100}` or `["train.steps=100"]` (values as YAML,
            like `--set`).
        needs_data: whether what follows reads data (False for export: then
            `data.train` may be left out).

    Raises:
        RecflowError: a bad config or override, naming the offending path.
    """
    from recflow.config.convert import to_dict
    from recflow.config.loader import apply_overrides, config_from_dict, load_config

    items = _override_items(overrides)
    if model_dir is not None:
        items.append(f"train.model_dir={json.dumps(os.fspath(model_dir))}")
    if isinstance(config_or_path, Config):
        return config_from_dict(apply_overrides(to_dict(config_or_path), items))
    if isinstance(config_or_path, (str, os.PathLike)):
        return load_config(os.fspath(config_or_path), items, needs_data=needs_data)
    raise RecflowError(
        f"expected a config file path or a recflow.Config, got {type(config_or_path).__name__}"
    )


def _override_items(overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str) or not isinstance(overrides, Iterable):
        raise RecflowError("overrides: expected a mapping or a list of 'key=value' strings")
    return list(overrides)


def make_trainer(config: Config, verbose: int = 0, callbacks=None, warm_start: str | None = None):
    """The trainer of a config: a `Trainer` (on the chief of a PS cluster, one whose steps run on the workers).

    A PS or worker task (from TF_CONFIG) serves until it is stopped and then exits.
    `warm_start`: see `train`.
    """
    if config.distribute.strategy == "parameter_server":
        if warm_start:
            raise RecflowError(
                "--warm-start: not supported under distribute.strategy parameter_server yet "
                "(warm-start a local model dir; resharding it onto parameter servers is not built)"
            )
        from recflow.distribute.cluster import read_tf_config, serve

        role = read_tf_config()
        if not role.coordinates:
            from recflow.data.sources import kernel_libraries

            serve(role, kernel_libraries(config))  # ps and worker tasks serve until stopped
            raise SystemExit(0)
        from recflow.distribute.ps_runner import ps_trainer

        return ps_trainer(config, role, verbose=verbose, callbacks=callbacks)
    from recflow.training.trainer import Trainer

    return Trainer(config, verbose=verbose, callbacks=callbacks, warm_start=warm_start)


def is_chief(config: Config) -> bool:
    """Whether this process writes the model dir (every task but PS and worker tasks)."""
    if config.distribute.strategy != "parameter_server":
        return True
    from recflow.distribute.cluster import read_tf_config

    return read_tf_config().coordinates


@contextmanager
def writer(config: Config, command: str):
    """Holds the model dir's writer lock after removing what killed writers left
    (nothing for PS and worker tasks, which write nothing)."""
    if not is_chief(config):
        yield
        return
    from recflow.training.lock import writer as model_dir_writer

    with model_dir_writer(config.train.model_dir, command):
        yield


def _checked(config_or_path, model_dir, overrides, reads_data: bool = True) -> Config:
    """The config, with its data sources checked when the command reads them."""
    from recflow.data import check_sources

    config = load(config_or_path, model_dir, overrides, needs_data=reads_data)
    if reads_data:
        check_sources(config)
    return config


def train(
    config_or_path,
    model_dir: str | None = None,
    callbacks=None,
    overrides=None,
    verbose: int = 0,
    warm_start: str | None = None,
    follow: bool = False,
    poll_seconds: float = 1.0,
    on_file=None,
    status_every: float | None = None,
) -> dict:
    """Trains (resuming from the model dir's latest checkpoint), evaluates and exports.

    The one train path: `recflow train` calls it too. A file run trains its
    epochs or steps; `follow` (files as they appear) and `data.format: kafka`
    are streams that train until `train.steps` or a signal.

    Args:
        config_or_path: a config file path or a `recflow.Config`.
        model_dir: overrides `train.model_dir`.
        callbacks: `tf_keras.callbacks.Callback`s run after the built-in ones each
            step (`on_train_batch_end(global_step, logs)`, `on_epoch_end`, ...); one
            may stop training with `self.model.stop_training = True`. SIGTERM and
            SIGINT (Ctrl-C, a notebook's interrupt) stop training after the current
            step with a final checkpoint; the result then holds `interrupted` (the
            signal's name) and no metrics: rerun to resume and finish.
        overrides: config overrides (see `load`).
        verbose: 1 shows a progress bar.
        warm_start: a model dir to start a new one from: its rows and dense weights
            wherever they still fit (same table and dim, same variable shapes); see
            `recflow.training.warm_start`. Ignored once the model dir has a checkpoint.
        follow: treat `data.train` as a stream of files (see `recflow.training.follow`);
            the files are checked as they come, not before.
        poll_seconds: with `follow`, how often to look for new records when idle.
        on_file: with `follow`, called with (file, examples, global step) after each file.
        status_every: streams: print a live line (rate, lag) at most this often.

    Returns:
        The metrics written to `MODEL_DIR/metrics.json` (or `already_done: True`
        when the model dir's run is complete; `interrupted` when a signal cut a
        file run short; `stopped`, the signal's name, when one ended a Kafka stream).

    Raises:
        RecflowError: `follow` with `data.format: kafka` (already a stream).
    """
    config = _checked(config_or_path, model_dir, overrides, reads_data=not follow)
    run = None
    if config.data.format == "kafka":
        if follow:
            raise RecflowError("--follow: data.format kafka is a stream already; leave --follow out")
        from recflow.training.kafka_stream import stream

        def run():
            return stream(trainer, status_every)
    elif follow:
        if config.distribute.strategy != "local":
            raise RecflowError("--follow: a stream of files trains with distribute.strategy local only")
        from recflow.training.follow import follow as follow_files

        def run():
            return follow_files(trainer, poll_seconds, on_file, status_every)

    with writer(config, "train"):
        trainer = make_trainer(config, verbose, callbacks, warm_start)
        return trainer.run(train=run)


def evaluate(config_or_path, model_dir: str | None = None, overrides=None) -> dict:
    """Evaluates the latest checkpoint and returns its metrics. In `metrics.json` they
    replace the previous evaluation's (its `eval_*` fields and metrics); the training's
    fields (`examples`, `bad_records`, `timing`, ...) stay, and `steps` is the checkpoint's.

    Raises:
        RecflowError: the model dir has no checkpoint.
    """
    with _restored(config_or_path, model_dir, overrides, "evaluate") as trainer:
        result = trainer.evaluate()
        result["steps"] = int(trainer.model.global_step)
        kept = without_evaluation(trainer.model_dir.metrics(), trainer.model.heads)
        trainer.model_dir.write_metrics({**kept, **result})
    return result


def without_evaluation(metrics: dict, heads) -> dict:
    """`metrics` (as in metrics.json) without the evaluation it holds: the `eval_*` fields
    and the metrics `eval_metrics` lists, or, in a file written before that list, the keys
    that name a metric of one of `heads` (`auc`, `<head>/auc`)."""
    listed = metrics.get("eval_metrics")
    listed = set(listed) if isinstance(listed, list) else set()

    def evaluated(key: str) -> bool:
        return (
            key.startswith("eval_")
            or key in listed
            or any(h.accepts_metric(key.rpartition("/")[2]) for h in heads)
        )

    return {k: v for k, v in metrics.items() if not evaluated(k)}


def export(config_or_path, model_dir: str | None = None, overrides=None, delta: bool = False) -> str:
    """Writes `export/<step>/` (or `deltas/<step>/` with `delta`) from the latest checkpoint;
    returns its path.

    Raises:
        RecflowError: the model dir has no checkpoint.
    """
    with _restored(config_or_path, model_dir, overrides, "export") as trainer:
        return trainer.model_dir.write_delta() if delta else trainer.model_dir.export()


@contextmanager
def _restored(config_or_path, model_dir, overrides, command: str):
    """A trainer on the model dir's latest checkpoint, holding its writer lock for `command`."""
    config = _checked(config_or_path, model_dir, overrides, reads_data=command != "export")
    with writer(config, command):
        trainer = make_trainer(config)
        require_checkpoint(trainer)
        yield trainer


def require_checkpoint(trainer) -> None:
    """Restores the latest checkpoint; raises RecflowError when there is none."""
    step = trainer.model_dir.restore()
    if step == 0:
        raise RecflowError(f"{trainer.model_dir.checkpoint_dir}: no checkpoint to read (train first)")
