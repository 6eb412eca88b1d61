"""Checkpoints on disk: the digest covers every byte, and only a checkpoint that verifies is loaded."""

import argparse
import hashlib
import json
import os

import pytest

torch = pytest.importorskip("torch")

from fixtures.checkpoints import data_name, load, manifest_name, save_steps  # noqa: E402
from trainpod.train.checkpoint import Checkpointer, CheckpointError, files  # noqa: E402

# --- names and digest ---------------------------------------------------------------------------


def test_only_canonical_names_are_checkpoint_files():
    names = [data_name(1), manifest_name(1), data_name(2), "ckpt-3.pt", "ckpt-3.json", "ckpt-000000004.pt",
             f".{data_name(5)}.x1.tmp", f".{data_name(6)}.x1", "notes.txt"]
    assert files.listed_steps(names) == ({1, 2}, {1})
    assert files.leftovers(names) == [f".{data_name(5)}.x1.tmp", data_name(2)]


def test_the_sha256_covers_every_byte_of_the_file(tmp_path):
    # torch.save writes in chunks of every size: zip headers, padding, the pickle, tensors small and
    # large (one not contiguous); the manifest's digest and size are those of the whole file.
    state = {"big": torch.randn(300_000), "small": torch.ones(3), "empty": torch.empty(0),
             "strided": torch.arange(4096.0).view(64, 64).t(), "bytes": bytes(range(256)), "text": "x" * 10_000}
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, state)
    manifest = json.loads((tmp_path / manifest_name(1)).read_text())
    data = (tmp_path / data_name(1)).read_bytes()
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest() and manifest["size"] == len(data)
    (step, loaded), _ = load(tmp_path)
    assert step == 1 and all(torch.equal(loaded[k], state[k]) for k in ("big", "small", "empty", "strided"))


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_byte_anywhere_in_the_file_is_caught(tmp_path, where):
    save_steps(tmp_path, [1, 2])
    path = tmp_path / data_name(2)
    data = bytearray(path.read_bytes())
    data[0 if where == "first" else -1] ^= 0x01  # the middle: test_a_flipped_byte_is_reported_as_a_sha256_mismatch
    path.write_bytes(bytes(data))
    (step, _), lines = load(tmp_path)
    assert step == 1
    assert [line for line in lines if line.startswith("skipping")] == [
        f"skipping {path}: corrupt (sha256 mismatch: {hashlib.sha256(data).hexdigest()[:12]}..., its manifest says "
        f"{json.loads((tmp_path / manifest_name(2)).read_text())['sha256'][:12]}...)"
    ]


# --- verified load ------------------------------------------------------------------------------


def test_state_beyond_the_weights_only_allowlist_loads_only_when_trusted(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINPOD_TRUST_CHECKPOINTS", raising=False)
    state = {"args": argparse.Namespace(lr=0.1, name="run"), "w": torch.ones(3)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    with pytest.raises(CheckpointError, match=r"not loaded: it holds argparse\.Namespace") as raised:
        load(tmp_path)
    assert raised.value.exit_code == 78  # tests/unit/train/checkpoint/test_trust.py: what may run, and the way out
    step, loaded = Checkpointer(tmp_path, trusted=True, log=lambda line: None).load_latest()
    assert loaded["args"] == state["args"]


def test_a_truncated_newest_checkpoint_is_reported_and_skipped(tmp_path):
    save_steps(tmp_path, [1, 2])
    path = tmp_path / data_name(2)
    os.truncate(path, path.stat().st_size // 2)
    (step, state), lines = load(tmp_path)
    assert step == 1 and state["step"] == 1
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and str(path) in skipped[0] and "truncated" in skipped[0]


def test_a_flipped_byte_is_reported_as_a_sha256_mismatch(tmp_path):
    save_steps(tmp_path, [1, 2])
    path = tmp_path / data_name(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    (step, _), lines = load(tmp_path)
    assert step == 1
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and str(path) in skipped[0] and "sha256" in skipped[0]


def test_data_without_a_manifest_is_not_a_checkpoint(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / manifest_name(2)).unlink()
    (step, _), lines = load(tmp_path)
    assert step == 1
    assert not [line for line in lines if line.startswith("skipping")]


def test_an_unreadable_manifest_is_reported_and_skipped(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / manifest_name(2)).write_text('{"format": "trainpod-checkpoint", "vers')
    (step, _), lines = load(tmp_path)
    assert step == 1
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and manifest_name(2) in skipped[0] and "unreadable manifest" in skipped[0]


def test_with_no_good_checkpoint_it_starts_fresh_and_says_so(tmp_path):
    assert load(tmp_path / "never-created") == (None, [f"no checkpoint in {tmp_path / 'never-created'}: starting fresh"])
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        os.truncate(tmp_path / data_name(step), 10)
    result, lines = load(tmp_path)
    assert result is None
    assert len([line for line in lines if line.startswith("skipping")]) == 2
    assert lines[-1] == f"no checkpoint in {tmp_path}: starting fresh"


def test_a_verified_file_that_torch_cannot_load_is_an_error_not_a_fresh_start(tmp_path):
    save_steps(tmp_path, [1])
    junk = b"not a torch file"
    (tmp_path / data_name(2)).write_bytes(junk)
    manifest = json.loads((tmp_path / manifest_name(1)).read_text())
    manifest.update(step=2, file=data_name(2), size=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    (tmp_path / manifest_name(2)).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="matches its manifest's sha256, but torch.load cannot read it") as raised:
        Checkpointer(tmp_path, log=lambda line: None).load_latest()
    assert raised.value.exit_code == 78 and "\n" not in str(raised.value)  # this environment, not damage: fix the job


def test_leftovers_of_a_killed_writer_are_ignored_and_cleaned_by_the_next_writer(tmp_path):
    save_steps(tmp_path, [1])
    leftovers = [f".{data_name(2)}.k1ll3d.tmp", f".{manifest_name(2)}.k1ll3d.tmp", data_name(3)]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")

    (step, _), lines = load(tmp_path)  # a reading rank: ignores them and deletes nothing
    assert step == 1 and not [line for line in lines if line.startswith("skipping")]
    assert all((tmp_path / name).exists() for name in leftovers)

    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(4, {"step": 4})
    assert not any((tmp_path / name).exists() for name in leftovers)
    assert lines == [f"removed 3 leftover file(s) of interrupted saves from {tmp_path}"]
