"""Reading a run's tracker runs back with each tracker's own reader (shared by test modules)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run's event files -> [(step, value)], read by TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_client(uri: str):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_history(client, run: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run, key))


def wandb_records(path: Path):
    """The records of a W&B offline run file (``run-<id>.wandb``): W&B's own protobuf ``Record``s in
    its LevelDB-style log (7-byte file header, 32 KiB blocks of crc/length/type-framed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(path: Path) -> tuple[list[dict], dict]:
    """(history rows, summary) of a W&B offline run file."""
    history, summary = [], {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
        elif kind == "summary":
            for i in r.summary.update:
                summary[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return history, summary
