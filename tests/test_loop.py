"""The training loop: callback order, a user callback that stops training, the Python API."""

import json

import pytest
from conftest import DEMO as CONFIG
from conftest import small

import recflow

# 10 steps (640 rows of 64): the run's end is off the every-4 schedule of the hooks test.
SMALL = small({"data.synthetic": {"rows": 640, "eval_rows": 128, "seed": 3, "schema": "demo"}, "data.batch_size": 64})


@pytest.fixture(scope="module")
def tf_keras():
    import tf_keras

    return tf_keras


def recording_trainer(config, events, callbacks):
    """A trainer whose model dir records its evictions, deltas, exports and checkpoints."""
    from recflow.training.trainer import Trainer

    trainer = Trainer(config, verbose=0, callbacks=callbacks)
    model_dir = trainer.model_dir
    names = {"evict": "evict", "write_delta": "delta", "export": "export", "save_checkpoint": "checkpoint"}
    for method, event in names.items():
        def recorded(*args, _run=getattr(model_dir, method), _event=event, **kwargs):
            events.append((_event, int(trainer.model.global_step)))
            return _run(*args, **kwargs)

        setattr(model_dir, method, recorded)  # also what `save_checkpoint` calls for its eviction
    return trainer


def test_hooks_run_evict_delta_export_checkpoint_then_user_callbacks(tmp_path, tf_keras):
    from recflow.api import load

    events = []

    class Record(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            assert logs["previous_step"] == batch - 1  # the local loop runs one step at a time
            events.append(("user", batch))

        def on_epoch_end(self, epoch, logs=None):
            events.append(("epoch_end", epoch))

    overrides = dict(SMALL, **{
        "train.checkpoint_every_steps": 4, "export.delta_every_steps": 4, "export.every_steps": 8,
    })
    config = load(CONFIG, str(tmp_path / "m"), overrides)
    trainer = recording_trainer(config, events, [Record()])
    summary = trainer.fit()
    assert summary["steps"] == 10  # 640 rows / 64
    expected = []
    for step in range(1, 11):
        if step % 4 == 0:
            expected += [("evict", step), ("delta", step)]
            if step % 8 == 0:
                expected.append(("export", step))
            expected.append(("checkpoint", step))
        expected.append(("user", step))
    expected += [("epoch_end", 0), ("checkpoint", 10), ("evict", 10)]  # final checkpoint evicts
    assert events == expected


def test_a_user_callback_stops_training_with_a_final_checkpoint(tmp_path, tf_keras):
    class StopAt(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                self.model.stop_training = True

    metrics = recflow.train(CONFIG, model_dir=str(tmp_path / "m"), callbacks=[StopAt()], overrides=SMALL)
    assert metrics["steps"] == 3 and metrics["examples"] == 3 * 64
    assert (tmp_path / "m" / "checkpoints" / "ckpt-3.index").exists()


def test_api_train_evaluate_export(tmp_path):
    import recflow.exporter.saved_model  # noqa: F401  (a loaded subpackage must not shadow `recflow.export`)

    model_dir = tmp_path / "m"
    metrics = recflow.train(CONFIG, model_dir=str(model_dir), overrides=["train.steps=4", "train.epochs=null",
                            "data.batch_size=64", "model.params={dnn: {hidden_units: [8]}}",
                            "data.synthetic={rows: 640, eval_rows: 128, seed: 3, schema: demo}"])
    assert metrics == json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["examples"] == 4 * 64 == metrics["examples_read"]
    assert metrics["export"] == str(model_dir / "export" / "4")

    again = recflow.evaluate(CONFIG, model_dir=str(model_dir), overrides=SMALL)
    assert again["auc"] == metrics["auc"] and again["steps"] == 4

    path = recflow.export(CONFIG, model_dir=str(model_dir), overrides=SMALL, delta=True)
    assert path == str(model_dir / "deltas" / "4")
    with pytest.raises(recflow.errors.RecflowError, match="overrides"):
        recflow.train(CONFIG, model_dir=str(model_dir), overrides="train.steps=4")
