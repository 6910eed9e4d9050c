"""Captures: exact round trip, compaction, NaN-poisoned replay, atomic writes, recording."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import sparse_mla
from sparse_mla import _files as files
from sparse_mla import capture as cap
from sparse_mla import reference
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import sparse_mla_prefill_ref

DATA = Path(__file__).resolve().parent.parent / "data" / "captures"


def _call(T=6, H=4, D=64, N=40, *, dtype=torch.bfloat16, index_dtype=torch.int32, sink=True,
          seed=0, spare_ends=True):  # fmt: skip
    """Random call inputs. Valid slots avoid rows 0 and N-1 (with ``spare_ends``) so that a
    kernel that clamps or wraps an invalid slot lands on an unreferenced (NaN on replay) row.
    Every kind of invalid slot appears: -1, N, 2^31 - 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    lengths = torch.randint(1, 9, (T,), generator=g)
    lengths[T // 2] = 0  # an empty token
    ptr = torch.zeros(T + 1, dtype=torch.int64)
    ptr[1:] = lengths.cumsum(0)
    lo, hi = (1, N - 1) if spare_ends else (0, N)
    idx = torch.randint(lo, hi, (int(ptr[-1]),), generator=g)
    bad = torch.tensor([-1, N, 2**31 - 1])
    idx[::3] = bad[torch.arange(idx[::3].numel()) % 3]
    s = torch.randn(H, generator=g) if sink else None
    return q, kv, idx.to(index_dtype), ptr.to(index_dtype), D**-0.5, s


def _save(tmp_path, name="c.safetensors", **kw):
    q, kv, idx, ptr, scale, s = _call(**kw)
    path = cap.save_capture(
        tmp_path / name, q, kv, idx, ptr, scale, s, source="unit test", extra={"k": [1, 2]}
    )
    return path, (q, kv, idx, ptr, scale, s)


# ----------------------------------------------------------------------------------------------
# Round trip and compaction
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,index_dtype,sink",
    [(torch.bfloat16, torch.int32, True), (torch.float16, torch.int64, False)],
)
def test_round_trip_is_exact(tmp_path, dtype, index_dtype, sink):
    q, kv, idx, ptr, scale, s = _call(dtype=dtype, index_dtype=index_dtype, sink=sink)
    q_strided = torch.empty(q.shape[0], q.shape[1] + 3, q.shape[2], dtype=dtype)[:, 1:-2]
    q_strided.copy_(q)  # a strided q is stored contiguous, values unchanged
    data, meta = cap.encode_capture(q_strided, kv, idx, ptr, scale, s, source="src", extra={"a": 1})
    path = tmp_path / "rt.safetensors"
    cap._atomic_write(path, data)
    c = cap.load_capture(path)

    assert c.metadata == meta
    assert torch.equal(c.q, q) and c.q.dtype == dtype
    assert c.kv_indices.dtype == index_dtype and torch.equal(c.kv_indices, idx)
    assert c.kv_indptr.dtype == index_dtype and torch.equal(c.kv_indptr, ptr)
    valid = idx.long()[(idx.long() >= 0) & (idx.long() < kv.shape[0])]
    assert torch.equal(c.kv_slots, torch.unique(valid))
    assert torch.equal(c.kv_rows, kv[c.kv_slots])
    assert (c.attn_sink is None) == (s is None)
    if s is not None:
        assert torch.equal(c.attn_sink, s)
    assert c.softmax_scale == scale and c.num_kv == kv.shape[0]
    m = c.metadata
    assert m["source"] == "src" and m["extra"] == {"a": 1}
    assert m["call"]["q_strides"] == list(q_strided.stride())
    assert m["slots"]["nnz"] == idx.numel()
    assert m["slots"]["invalid"] == int(((idx.long() < 0) | (idx.long() >= kv.shape[0])).sum())
    assert m["slots"]["unique_rows"] == c.kv_slots.numel()
    assert m["slots"]["empty_tokens"] >= 1
    assert m["environment"]["torch"] == torch.__version__

    w = c.rebuild("cpu")
    assert w.kv.shape == kv.shape and w.kv.dtype == dtype
    used = torch.zeros(kv.shape[0], dtype=torch.bool)
    used[c.kv_slots] = True
    assert torch.equal(w.kv[used], kv[used])
    assert torch.isnan(w.kv[~used].float()).all() and (~used).any()


def test_kv_with_singleton_head_dim_and_empty_call(tmp_path):
    q, kv, idx, ptr, scale, s = _call()
    p = cap.save_capture(tmp_path / "a.safetensors", q, kv[:, None, :], idx, ptr, scale, s)
    assert torch.equal(cap.load_capture(p).kv_rows, kv[cap.load_capture(p).kv_slots])
    # T = 0 and an empty pool are valid calls and valid captures.
    e = cap.save_capture(tmp_path / "e.safetensors", q[:0], kv[:0], idx[:0], ptr[:1], scale, s)
    c = cap.load_capture(e)
    assert c.q.shape[0] == 0 and c.num_kv == 0 and c.kv_rows.shape == (0, kv.shape[1])


def test_compacted_file_is_much_smaller_than_the_pool(tmp_path):
    N, D = 65536, 64
    q, _, idx, ptr, scale, s = _call(T=16, D=D, N=N)
    kv = torch.randn(N, D).to(torch.bfloat16)
    path = cap.save_capture(tmp_path / "big.safetensors", q, kv, idx, ptr, scale, s)
    pool_bytes = kv.numel() * kv.element_size()
    assert path.stat().st_size * 50 < pool_bytes
    c = cap.load_capture(path)
    assert c.num_kv == N and c.kv_rows.shape[0] < 16 * 8


# ----------------------------------------------------------------------------------------------
# Replay: unreferenced rows are NaN
# ----------------------------------------------------------------------------------------------


def _clamping_ref(q, kv, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None):
    """A deliberately wrong kernel: clamps invalid slots into range instead of skipping them."""
    idx = kv_indices.long().clamp(0, kv.shape[0] - 1)
    return sparse_mla_prefill_ref(q, kv, idx, kv_indptr, softmax_scale, attn_sink=attn_sink)


def _wrapping_ref(q, kv, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None):
    """Another wrong kernel: reads row s % N for every slot."""
    idx = kv_indices.long().remainder(kv.shape[0])
    return sparse_mla_prefill_ref(q, kv, idx, kv_indptr, softmax_scale, attn_sink=attn_sink)


def test_nan_rows_never_reach_the_triton_kernel_output(tmp_path):
    path, (q, kv, idx, ptr, scale, s) = _save(tmp_path)
    c = cap.load_capture(path)
    w = c.rebuild("cpu")
    assert torch.isnan(w.kv.float()).any()
    out = torch.full_like(q, float("nan"))
    sparse_mla_prefill(*w.args(), **w.kwargs(), out=out)
    assert torch.isfinite(out.float()).all()
    # Same rows in the same order: bit-identical to the call on the original pool.
    out_orig = torch.full_like(q, float("nan"))
    sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=s, out=out_orig)
    assert torch.equal(out, out_orig)
    report = cap.replay(c, device="cpu")
    assert report.ok and report.nan_outputs == 0, str(report)


@pytest.mark.parametrize("wrong", [_clamping_ref, _wrapping_ref])
def test_nan_rows_do_reach_a_wrong_kernel(tmp_path, wrong):
    path, (q, kv, idx, ptr, scale, s) = _save(tmp_path)
    # On the engine's original (finite) pool the wrong kernel's output looks harmless ...
    assert torch.isfinite(wrong(q, kv, idx, ptr, scale, attn_sink=s)).all()
    # ... on the replayed pool it reads NaN rows and fails loudly.
    report = cap.replay(path, wrong, device="cpu")
    assert report.nan_outputs > 0 and not report.ok
    assert cap.replay(path, sparse_mla_prefill_ref, device="cpu").ok


def test_rebuild_inside_a_big_buffer(tmp_path):
    path, _ = _save(tmp_path, T=3)
    w = cap.load_capture(path).rebuild("cpu", big_buffer=True)
    elt = w.kv.element_size()
    assert w.kv.untyped_storage().nbytes() > 2**31
    assert w.kv.storage_offset() * elt >= 2**31
    out = sparse_mla_prefill(*w.args(), **w.kwargs())
    assert torch.isfinite(out.float()).all()
    assert reference.check_against_reference(out, *w.args(), **w.kwargs()).ok


# ----------------------------------------------------------------------------------------------
# Damaged files and atomic writes
# ----------------------------------------------------------------------------------------------


def test_truncated_file_gives_a_clear_error(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut in (0, 5, 8 + n // 2, 8 + n + 10, len(raw) - 1):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        with pytest.raises(cap.CaptureError, match="truncated"):
            cap.load_capture(bad)


def test_tampered_file_gives_a_clear_error(tmp_path):
    path, _ = _save(tmp_path)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    flipped = bytearray(raw)
    flipped[8 + n + 3] ^= 0x40  # a byte of tensor data
    (tmp_path / "flip.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(cap.CaptureError, match="hash mismatch"):
        cap.load_capture(tmp_path / "flip.safetensors")
    # Edit the metadata: a different source of the same length keeps the file well-formed.
    edited = bytes(raw).replace(b"unit test", b"unit TEST")
    assert edited != bytes(raw)
    (tmp_path / "edit.safetensors").write_bytes(edited)
    with pytest.raises(cap.CaptureError, match="hash mismatch"):
        cap.load_capture(tmp_path / "edit.safetensors")
    # Valid safetensors that is not a capture.
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(cap.CaptureError, match="not a sparse_mla capture"):
        cap.load_capture(tmp_path / "other.safetensors")


def _same_capture(a, b) -> bool:
    same = a.metadata == b.metadata and (a.attn_sink is None) == (b.attn_sink is None)
    for name in ("q", "kv_rows", "kv_slots", "kv_indices", "kv_indptr", "attn_sink"):
        x, y = getattr(a, name), getattr(b, name)
        same = same and (x is None or (x.dtype == y.dtype and torch.equal(x, y)))
    return same


@pytest.mark.parametrize("mask", [0x01, 0x20, 0x80, 0xFF])
def test_every_header_byte_flip_is_a_capture_error(tmp_path, mask):
    # A flipped byte anywhere in the length prefix or the JSON header either still decodes to
    # the same capture (it cannot: the hash covers it, but the test does not assume so) or
    # raises CaptureError; never KeyError/TypeError/AttributeError or a wrong capture.
    path, _ = _save(tmp_path)
    good = cap.load_capture(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    bad = tmp_path / "bad.safetensors"
    outcomes = {"error": 0, "same": 0}
    for i in range(8 + n):
        flipped = bytearray(raw)
        flipped[i] ^= mask
        bad.write_bytes(bytes(flipped))
        try:
            c = cap.load_capture(bad)
        except cap.CaptureError:
            outcomes["error"] += 1
            continue
        assert _same_capture(c, good), f"byte {i} ^ {mask:#x} loaded a different capture"
        outcomes["same"] += 1
    assert outcomes["error"] > 0.9 * (8 + n), outcomes


def _resave(raw: bytes, tensors=None, meta_text=None, extra_meta=None) -> bytes:
    """The capture re-encoded with replaced tensors or metadata text (hash not recomputed)."""
    from safetensors.torch import load, save

    t = load(raw) if tensors is None else tensors
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = dict(header["__metadata__"])
    if meta_text is not None:
        meta[cap._META_KEY] = meta_text
    meta.update(extra_meta or {})
    return save(t, metadata=meta)


def test_malformed_metadata_and_tensors_are_capture_errors(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    meta = json.loads(json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"][
        cap._META_KEY
    ])  # fmt: skip

    def rehashed(meta_obj, tensors=None):
        from safetensors.torch import load

        t = load(raw) if tensors is None else tensors
        if isinstance(meta_obj, dict):
            meta_obj = {**meta_obj, cap._HASH_KEY: cap._content_hash(t, meta_obj)}
        return _resave(raw, tensors=t, meta_text=json.dumps(meta_obj))

    from safetensors.torch import load

    tensors = load(raw)
    cases = {
        "list": _resave(raw, meta_text="[1, 2, 3]"),
        "string": _resave(raw, meta_text='"capture"'),
        "number": _resave(raw, meta_text="7"),
        "not json": _resave(raw, meta_text="{nope"),
        "no call": rehashed({k: v for k, v in meta.items() if k != "call"}),
        "call not object": rehashed({**meta, "call": [1]}),
        "num_kv string": rehashed({**meta, "call": {**meta["call"], "num_kv": "40"}}),
        "q 2-D": rehashed(meta, {**tensors, "q": tensors["q"][0]}),
        "indptr short": rehashed(meta, {**tensors, "kv_indptr": tensors["kv_indptr"][:-1]}),
        "slot past N": rehashed(
            meta, {**tensors, "kv_slots": tensors["kv_slots"] + meta["call"]["num_kv"]}
        ),
        "sink dropped": rehashed(meta, {k: v for k, v in tensors.items() if k != "attn_sink"}),
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(cap.CaptureError):
            cap.load_capture(bad)
    # The rehashing helper itself yields a loadable capture when nothing is broken.
    (tmp_path / "ok.safetensors").write_bytes(rehashed(meta))
    assert cap.load_capture(tmp_path / "ok.safetensors").num_kv == meta["call"]["num_kv"]
    # A header whose entries are not objects, and a __metadata__ that is not one.
    for header in ({"q": [1, 2]}, {"__metadata__": [1]}, {"q": {"data_offsets": "x"}}):
        body = json.dumps(header).encode()
        bad = tmp_path / "header.safetensors"
        bad.write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(cap.CaptureError):
            cap.load_capture(bad)


def _rehashed(raw: bytes, meta_obj: dict, tensors=None) -> bytes:
    """The capture ``raw`` with metadata ``meta_obj`` (and ``tensors``) and a valid hash."""
    from safetensors.torch import load

    t = load(raw) if tensors is None else tensors
    meta_obj = {**meta_obj, cap._HASH_KEY: cap._content_hash(t, meta_obj)}
    return _resave(raw, tensors=t, meta_text=json.dumps(meta_obj))


def _meta_of(raw: bytes) -> dict:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][cap._META_KEY])


def _no_tensor_read(monkeypatch):
    import safetensors.torch

    def refuse(*a, **k):
        raise AssertionError("the tensors were read before the metadata was checked")

    monkeypatch.setattr(safetensors.torch, "load", refuse)


@pytest.mark.parametrize(
    ("what", "call", "said"),
    [
        ("num_kv 1e15", {"num_kv": 10**15}, "pool, over the"),
        ("num_kv float", {"num_kv": 1e15}, "call.num_kv must be an int"),
        ("num_kv bool", {"num_kv": True}, "call.num_kv must be an int"),
        ("scale NaN", {"softmax_scale": float("nan")}, "softmax_scale must be a finite"),
        ("scale inf", {"softmax_scale": float("inf")}, "softmax_scale must be a finite"),
        ("scale 1e400", {"softmax_scale": 10**400}, "softmax_scale must be a finite"),
        ("scale over fp32", {"softmax_scale": 1e39}, "softmax_scale must be a finite"),
        ("T", {"T": 7}, "disagrees with tensor q"),
        ("H", {"H": 5}, "disagrees with tensor q"),
        ("D", {"D": 32}, "disagrees"),
        ("T missing", {"T": None}, "call.T must be an int"),
        ("kv_shape", {"kv_shape": [41, 64]}, "kv_shape"),
    ],
)
def test_impossible_call_metadata_is_refused_before_the_tensors_are_read(
    tmp_path, monkeypatch, what, call, said
):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    meta = _meta_of(raw)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_rehashed(raw, {**meta, "call": {**meta["call"], **call}}))
    _no_tensor_read(monkeypatch)
    with pytest.raises(cap.CaptureError, match=said) as info:
        cap.load_capture(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


def test_bad_kv_indptr_with_a_valid_hash_is_a_capture_error(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    meta = _meta_of(raw)
    from safetensors.torch import load

    tensors = load(raw)
    ptr, nnz = tensors["kv_indptr"], tensors["kv_indices"].numel()
    down = ptr.clone()
    down[2], down[3] = ptr[3], ptr[2] - 1  # not monotone
    past = ptr.clone()
    past[-1] = nnz + 1  # reads past kv_indices
    negative = ptr.clone()
    negative[0] = -1
    for name, bad_ptr, said in ((("down", down, "non-decreasing"), ("past", past, "past the end"),
                                 ("negative", negative, "negative"))):  # fmt: skip
        assert not torch.equal(bad_ptr, ptr)
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(_rehashed(raw, meta, {**tensors, "kv_indptr": bad_ptr}))
        with pytest.raises(cap.CaptureError, match=said):
            cap.load_capture(bad)
    # A window of kv_indices (last entry below nnz) is a valid call, so a valid capture.
    window = ptr.clone()
    window[-1] = ptr[-2]
    ok = tmp_path / "window.safetensors"
    ok.write_bytes(_rehashed(raw, meta, {**tensors, "kv_indptr": window}))
    assert torch.equal(cap.load_capture(ok).kv_indptr, window)


def test_non_regular_and_huge_files_are_refused_without_reading_them(tmp_path, monkeypatch):
    import os
    import threading
    import time

    _no_tensor_read(monkeypatch)
    for special in ("/dev/zero", str(tmp_path)):
        with pytest.raises(cap.CaptureError, match="not a regular file"):
            cap.load_capture(special)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    box: dict = {}

    def load_fifo():
        try:
            cap.load_capture(fifo)
        except Exception as e:
            box["e"] = e

    t = threading.Thread(target=load_fifo, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "load_capture hangs on a FIFO"
    assert isinstance(box.get("e"), cap.CaptureError) and "not a regular file" in str(box["e"])
    # 20 GiB sparse files: a valid capture padded, zeros, and a header length past the limit.
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    huge = 20 << 30
    cases = {
        "padded": (raw, "truncated or padded"),
        "zeros": (b"", "not valid JSON"),
        "long header": (struct.pack("<Q", 1 << 34), "over safetensors'"),
    }
    for name, (start, said) in cases.items():
        f = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        f.write_bytes(start)
        os.truncate(f, huge)
        t0 = time.perf_counter()
        with pytest.raises(cap.CaptureError, match=said):
            cap.load_capture(f)
        assert time.perf_counter() - t0 < 5, name
        f.unlink()
    with pytest.raises(FileNotFoundError):
        cap.load_capture(tmp_path / "none.safetensors")


def test_killed_writer_leaves_a_temp_that_the_next_write_removes(tmp_path):
    # A writer SIGKILLed between writing its temp file and renaming it (fsync stalls here)
    # leaves ".<name>.<pid>.<hex>.tmp"; the next write to that folder removes it.
    import signal
    import subprocess
    import sys

    code = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from sparse_mla import _files\n"
        "def stall(fd):\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(600)\n"
        "_files.os.fsync = stall\n"
        f"_files.atomic_write({str(tmp_path / 'k.safetensors')!r}, b'x' * 4096)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".k.safetensors.") and left[0].endswith(".tmp")
    assert f".{proc.pid}." in left[0]
    # A live writer's temp (this process's pid) is kept; the dead writer's one goes.
    live = tmp_path / f".other.safetensors.{__import__('os').getpid()}.0123abcd.tmp"
    live.write_bytes(b"in flight")
    path, _ = _save(tmp_path, name="next.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "next.safetensors"])
    assert cap.load_capture(path).metadata["source"] == "unit test"
    # Old enough, even a live pid's temp is stale.
    assert files.clean_stale_temps(tmp_path, max_age=0.0) == [live]


class _FailingFile:
    """Writes half of what it is given, then fails like a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_failed_write_leaves_nothing_partial(tmp_path, monkeypatch):
    q, kv, idx, ptr, scale, s = _call()
    target = tmp_path / "x.safetensors"
    real_open = open
    monkeypatch.setattr(files, "open", lambda *a, **k: _FailingFile(real_open(*a, **k)),
                        raising=False)  # fmt: skip
    with pytest.raises(OSError, match="No space"):
        cap.save_capture(target, q, kv, idx, ptr, scale, s)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    # An existing capture survives a failed overwrite (here: fsync fails after the write).
    cap.save_capture(target, q, kv, idx, ptr, scale, s, source="old")

    def bad_fsync(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(files.os, "fsync", bad_fsync)
    with pytest.raises(OSError, match="I/O error"):
        cap.save_capture(target, q, kv, idx, ptr, scale, s, source="new")
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
    assert cap.load_capture(target).metadata["source"] == "old"


def test_size_cap_on_a_single_save(tmp_path):
    q, kv, idx, ptr, scale, s = _call()
    with pytest.raises(cap.CaptureTooLarge):
        cap.save_capture(tmp_path / "a.safetensors", q, kv, idx, ptr, scale, s, max_bytes=100)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# Recorder
# ----------------------------------------------------------------------------------------------


def _fake_kernel(q, kv, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None):
    return q.new_zeros(q.shape)


def test_sampling_every_and_first(tmp_path):
    args = _call()
    with cap.Recorder(tmp_path, _fake_kernel, every=3, first=10) as rec:
        for _ in range(20):
            rec.fn(*args[:5], attn_sink=args[5])
    assert rec.calls == 20
    assert [p.name for p in rec.files] == [f"call_{i:05d}.safetensors" for i in (0, 3, 6, 9)]
    assert sorted(tmp_path.iterdir()) == sorted(rec.files)
    for i, p in zip((0, 3, 6, 9), rec.files, strict=True):
        assert cap.load_capture(p).metadata["extra"]["call"] == i

    with cap.Recorder(tmp_path / "m", _fake_kernel, every=2, max_files=2) as rec:
        for _ in range(9):
            rec.fn(*args[:5])
    assert [p.name for p in rec.files] == ["call_00000.safetensors", "call_00002.safetensors"]


def test_size_cap_holds(tmp_path):
    args = _call()
    one = len(cap.encode_capture(*args)[0])
    cap_bytes = int(2.5 * one)
    with cap.Recorder(tmp_path, _fake_kernel, max_bytes=cap_bytes) as rec:
        for _ in range(6):
            rec.fn(*args[:5], attn_sink=args[5])
    assert len(rec.files) == 2 and rec.skipped_for_size == 4
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total == rec.bytes_written <= cap_bytes


def test_patches_a_module_function_only_inside_the_block(tmp_path):
    original = reference.sparse_mla_prefill_ref
    q, kv, idx, ptr, scale, s = _call()
    target = "sparse_mla.reference:sparse_mla_prefill_ref"
    with cap.Recorder(tmp_path, target) as rec:
        assert reference.sparse_mla_prefill_ref is not original
        out = reference.sparse_mla_prefill_ref(q, kv, idx, ptr, scale, attn_sink=s)
    assert reference.sparse_mla_prefill_ref is original
    assert torch.equal(out, original(q, kv, idx, ptr, scale, attn_sink=s))
    assert len(rec.files) == 1
    assert target in cap.load_capture(rec.files[0]).metadata["source"]

    # The package entry and its alias are both patched by default, and both restored.
    entry = sparse_mla.sparse_mla_prefill
    with cap.Recorder(tmp_path / "d"):
        assert sparse_mla.sparse_mla_prefill is not entry
        assert sparse_mla.prefill.sparse_mla_prefill is sparse_mla.sparse_mla_prefill
    assert sparse_mla.sparse_mla_prefill is entry and sparse_mla.prefill.sparse_mla_prefill is entry

    # Restored even when the block raises.
    with pytest.raises(RuntimeError), cap.Recorder(tmp_path / "e", target):
        raise RuntimeError("boom")
    assert reference.sparse_mla_prefill_ref is original


def test_unimportable_target_is_a_clear_error(tmp_path):
    with (
        pytest.raises(ImportError, match="no_such_engine"),
        cap.Recorder(tmp_path, "no_such_engine.ops.sparse:pa_prefill_sparse"),
    ):
        pass
    with pytest.raises(AttributeError, match="nope"), cap.Recorder(tmp_path, "sparse_mla:nope"):
        pass
    with pytest.raises(ValueError, match="module:function"):
        cap.Recorder(tmp_path, "sparse_mla.sparse_mla_prefill").__enter__()


def test_engine_signature_and_recording_errors(tmp_path):
    q, kv, idx, ptr, scale, s = _call()

    def engine_prefill(query, unified_kv, indices, indptr, sm_scale, sink=None, out=None):
        return query

    with cap.Recorder(tmp_path, engine_prefill) as rec:
        rec.fn(query=q, unified_kv=kv, indices=idx, indptr=ptr, sm_scale=scale, sink=s)
        # A call the recorder cannot read still runs; the error is kept, nothing is written,
        # and the first such failure is said at once.
        with pytest.warns(RuntimeWarning, match="call 1 of .* was not recorded"):
            assert rec.fn(q, kv[:, :5], idx, ptr, scale) is q
    assert len(rec.files) == 1 and len(rec.errors) == 1 and "head dim" in rec.errors[0]
    c = cap.load_capture(rec.files[0])
    assert torch.equal(c.attn_sink, s) and torch.equal(c.kv_indices, idx)


def test_an_unmapped_call_warns_once_and_writes_nothing(tmp_path):
    # FlashMLA's (q, kv, indices, sm_scale) under the default mapping: indices is dense
    # [T, 1, topk] and there is no indptr, so nothing can be recorded; the user hears it once.
    q, kv, *_, scale, _ = _call()
    dense = torch.full((q.shape[0], 1, 8), -1, dtype=torch.int32)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                             topk_length=None):  # fmt: skip
        return q

    with cap.Recorder(tmp_path, flash_mla_sparse_fwd) as rec:
        with pytest.warns(RuntimeWarning, match="not recorded.*for_engine") as seen:
            rec.fn(q, kv[:, None, :], dense, scale, 64)
            rec.fn(q, kv[:, None, :], dense, scale, 64)
        assert len(seen) == 1
    assert rec.files == [] and len(rec.errors) == 2 and not list(tmp_path.iterdir())


def _flashmla_semantics(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """What FlashMLA's sparse prefill computes, written from its docstring with dense loops: per
    token, softmax over the valid entries of its first topk_length[t] indices (invalid: < 0 or
    >= s_kv), the sink adding exp(sink) to the denominator; a token with no valid entry gives
    zeros."""
    T, H, _ = q.shape
    kv2 = kv[:, 0, :].double()
    out = torch.zeros(T, H, d_v, dtype=torch.float64)
    for t in range(T):
        row = indices[t, 0, :]
        if topk_length is not None:
            row = row[: int(topk_length[t])]
        row = row[(row >= 0) & (row < kv.shape[0])].long()
        if row.numel() == 0:
            continue
        logits = q[t].double() @ kv2[row].T * sm_scale  # [H, n]
        m = logits.max(dim=1, keepdim=True).values
        if attn_sink is not None:
            m = torch.maximum(m, attn_sink.double()[:, None])
        p = (logits - m).exp()
        denom = p.sum(dim=1, keepdim=True)
        if attn_sink is not None:
            denom = denom + (attn_sink.double()[:, None] - m).exp()
        out[t] = (p / denom) @ kv2[row][:, :d_v]
    return out.to(q.dtype), None, None


@pytest.mark.parametrize("with_length", [False, True])
def test_flashmla_call_recorded_through_the_shipped_mapping_replays(tmp_path, with_length):
    g = torch.Generator().manual_seed(5)
    T, H, D, N, topk = 5, 16, 64, 48, 12
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, 1, D, generator=g).to(torch.bfloat16)
    indices = torch.randint(1, N - 1, (T, 1, topk), generator=g, dtype=torch.int32)
    indices[:, :, -3:] = -1  # padding
    indices[1, 0, 0] = N  # out of range: invalid
    indices[3, 0, :] = -1  # a token with nothing to attend to
    sink = torch.randn(H, generator=g)
    length = torch.tensor([12, 4, 0, 7, 9], dtype=torch.int32) if with_length else None

    def flash_mla_sparse_fwd(*args, **kwargs):  # stands in for FlashMLA's, same signature
        return _flashmla_semantics(*args, **kwargs)

    rec = cap.Recorder.for_engine("flashmla", tmp_path, target=flash_mla_sparse_fwd)
    with rec:
        out, _, _ = rec.fn(q, kv, indices, D**-0.5, d_v=D, attn_sink=sink, topk_length=length)
    assert rec.errors == [] and len(rec.files) == 1
    c = cap.load_capture(rec.files[0])
    assert c.synthetic is False and "flashmla" in c.metadata["source"]
    # Replay (every unreferenced pool row NaN) through the Triton kernel passes the fp32 check ...
    report = cap.replay(c, device="cpu")
    assert report.ok and report.nan_outputs == 0, str(report)
    # ... and the recorded slot lists mean what FlashMLA computed on the dense indices.
    w = c.rebuild("cpu")
    torch.testing.assert_close(
        sparse_mla_prefill_ref(*w.args(), **w.kwargs()).float(), out.float(), atol=2e-2, rtol=0
    )


def test_flashmla_mapping_refuses_what_it_cannot_represent():
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="d_qk=576 != d_v=512"):
        cap.flashmla_sparse_extract((q, kv, idx, 0.1), {})
    with pytest.raises(ValueError, match="without"):
        cap.flashmla_sparse_extract((q, kv), {})


def test_aiter_mapping_takes_the_prefix_source_and_refuses_an_extend():
    q, kv, idx, ptr, scale, s = _call()
    ops = cap.aiter_pa_prefill_sparse_extract(
        (q, kv, idx, ptr, None, None, None, s, scale), {"has_invalid": True}
    )
    assert ops["kv"] is kv and ops["kv_indices"] is idx and ops["kv_indptr"] is ptr
    assert ops["attn_sink"] is s and ops["softmax_scale"] == scale
    extend = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="extend"):
        cap.aiter_pa_prefill_sparse_extract((q, kv, idx, ptr, kv, extend, ptr, s, scale), {})
    assert set(cap.ENGINES) == {"flashmla", "vllm", "sglang", "aiter"}
    assert all(":" in m.target and m.checked for m in cap.ENGINES.values())


def test_update_metadata_keeps_tensors_and_refuses_call_fields(tmp_path):
    path, _ = _save(tmp_path)
    before = cap.load_capture(path)
    after = cap.update_metadata(path, synthetic=True, synthetic_note="made up")
    assert after.synthetic is True and after.metadata["synthetic_note"] == "made up"
    assert torch.equal(after.q, before.q) and torch.equal(after.kv_rows, before.kv_rows)
    with pytest.raises(ValueError, match="call"):
        cap.update_metadata(path, call={})


def test_cli_capture_and_replay(tmp_path, capsys):
    from sparse_mla.cli import main

    out = tmp_path / "w.safetensors"
    rc = main(["capture", "--workload", "csa_h8_topk512", "--tokens", "12", "--head-dim", "64",
               "--num-requests", "2", "--device", "cpu", "--kernel", "reference",
               "--calls", "3", "--every", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == ["w_00000.safetensors", "w_00002.safetensors"]
    meta = cap.load_capture(files[0]).metadata
    assert meta["extra"]["workload"] == "csa_h8_topk512" and meta["call"]["D"] == 64
    assert meta["synthetic"] is True  # a generated workload, labelled so
    assert main(["replay", str(files[0]), "--device", "cpu"]) == 0
    assert main(["replay", *map(str, files), "--kernel", "reference", "--info"]) == 0
    printed = capsys.readouterr().out
    assert "ok:" in printed and json.dumps("csa_h8_topk512") in printed


# ----------------------------------------------------------------------------------------------
# Shipped captures
# ----------------------------------------------------------------------------------------------

# By name, not a glob of the folder: a stray capture there (sparse-mla capture --out data/...)
# is no test case. Notebook 04 lists the same four.
SHIPPED = [
    DATA / f"{name}.safetensors"
    for name in (
        "csa_h16_topk512_t32_ctx4096",
        "csa_h8_topk512_t128_r2",
        "glm_h8_topk2048_t64",
        "hca_h16_t64_ctx8192",
    )
]


def test_shipped_captures_exist_and_are_documented():
    assert all(p.is_file() for p in SHIPPED)
    readme = (DATA.parent / "README.md").read_text()
    assert sum(p.stat().st_size for p in SHIPPED) < 8 * 2**20
    for p in SHIPPED:
        assert p.name in readme


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_capture_loads_and_replays(path):
    c = cap.load_capture(path)
    assert c.q.shape[-1] == 512 and c.metadata["source"].startswith("sparse-mla capture")
    assert c.synthetic is True and "not recorded from a serving engine" in c.metadata[
        "synthetic_note"]  # fmt: skip
    report = cap.replay(c, sparse_mla_prefill_ref, device="cpu")
    assert report.ok, str(report)


def test_shipped_capture_replays_through_the_triton_kernel():
    smallest = min(SHIPPED, key=lambda p: p.stat().st_size)
    report = cap.replay(smallest, device="cpu")
    assert report.ok and report.nan_outputs == 0, str(report)


@pytest.mark.parametrize("with_lengths", [False, True])
def test_dense_call_of_the_entry_is_recorded_as_its_csr_lists(tmp_path, with_lengths):
    """sparse_mla_prefill on dense [T, K] ids (-1 padded, absent ids, and with kv_lengths ids
    past each length that point at real rows) is recorded as the CSR lists it means; the
    capture's replay matches the call's output (the same lists, cut into other tiles)."""
    q, kv, *_, scale, s = _call()
    T, N = q.shape[0], kv.shape[0]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, N, (T, 9), generator=g, dtype=torch.int32)
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    ids[1, 3] = N + 4  # absent: outside the pool
    n = torch.randint(0, 10, (T,), generator=g, dtype=torch.int32) if with_lengths else None
    kw = {"kv_lengths": n} if with_lengths else {}
    with cap.Recorder(tmp_path):
        out = sparse_mla.sparse_mla_prefill(q, kv, ids, None, scale, attn_sink=s, **kw)
    (path,) = sorted(tmp_path.glob("*.safetensors"))
    c = cap.load_capture(path)
    assert c.kv_indices.dim() == 1 and c.kv_indptr.numel() == T + 1
    for t in range(T):
        row = ids[t, : (9 if n is None else int(n[t]))]
        got = c.kv_indices[c.kv_indptr[t] : c.kv_indptr[t + 1]]
        valid = row[(row >= 0) & (row < N)]
        assert torch.equal(got[(got >= 0) & (got < N)], valid), t
    args = c.rebuild("cpu")
    again = sparse_mla.sparse_mla_prefill(args.q, args.kv, args.kv_indices, args.kv_indptr,
                                          args.softmax_scale, attn_sink=args.attn_sink)  # fmt: skip
    assert not torch.isnan(again).any()
    torch.testing.assert_close(again, out, rtol=0.02, atol=0.02)
