"""The fit estimate is what the load does: engine.model.gguf_plan says per GGUF tensor type what a
native load holds (kept at its bits as which storage, or dequantized to which dtype, and the LM
head's extra copy), the loader decides through the same table, and the estimate is held against
real loads of the packaged model and of K-quant files (whatever the loader keeps today), together
with the process's memory, whose runtime part is measured."""

from __future__ import annotations

import gc

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_kquant_llama

from engine.config import EngineConfig, ModelSpec
from engine.core.service import Engine
from engine.events import MemorySample, ModelLoaded
from engine.kernels import native
from engine.model import gguf_plan, loading
from engine.model.inspect import inspect_model
from engine.model.runtime_memory import give_back_freed_memory, runtime_estimate

MIB = 2**20
POOL = 64 * MIB
TOLERANCE = 0.10
# The whole process is held to the same 10%. Measured here: within 2% (packaged model replacing
# itself 842 -> 843 MiB, the K-quant files replacing it 700 -> 685 and 685 -> 687 MiB), once the
# replaced engine's last reference goes before the next load (a caller's variable kept its
# weights, up to 110 MiB, in the next load's resident set).
PROCESS_TOLERANCE = TOLERANCE


@pytest.fixture
def kquant_files(tmp_path):
    tied = write_kquant_llama(tmp_path / "tiny-Q4_K_M.gguf")
    untied = write_kquant_llama(
        tmp_path / "tiny-Q2_K-Q3_K-Q5_K.gguf",
        {"attn_q": Q.Q5_K, "attn_k": Q.Q3_K, "attn_v": Q.Q2_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K},
        embedding_type=Q.Q8_0,
        output_type=Q.Q6_K,
    )
    return tied, untied


@pytest.fixture
def any_tokenizer(monkeypatch, default_tokenizer):
    """The tiny files carry no tokenizer: loads take the packaged model's (the weights are what
    these tests weigh)."""
    original = loading._load_tokenizer
    monkeypatch.setattr(
        loading, "_load_tokenizer", lambda src: default_tokenizer if src.kind == "gguf" else original(src)
    )


def lines_of(plan) -> dict[tuple[str, str], tuple[str, int]]:
    return {(line.ggml_type, line.held_as): (line.kind, line.tensors) for line in plan.lines}


@pytest.fixture(params=["kvk", "without kvk"])
def kernels(request, monkeypatch):
    """The two ways a load keeps a file here: the kvk kernels, or torch's layouts without them."""
    if request.param == "kvk" and native.kernels() is None:
        pytest.skip(f"no kvk kernels here: {native.status()}")
    if request.param != "kvk":
        monkeypatch.setattr(native, "kernels", lambda: None)
    return request.param


def test_the_plan_says_per_type_what_a_native_load_holds(kquant_files, kernels):
    tied, untied = kquant_files
    plan = gguf_plan.plan_file(tied, "float32")
    if kernels == "kvk":  # every type as the file stores it, memory-mapped
        assert lines_of(plan) == {
            ("Q4_K", "q4_k"): ("kept", 10),  # q, k, o, gate, up of 2 layers
            ("Q6_K", "q6_k"): ("kept", 5),  # v, down of 2 layers and the embedding
            ("F32", "float32"): ("dequantized", 5),  # the norms, in the load dtype
        }
        # linear Q4_K layers in panels where this build has them: 4 bytes more a row and 256 weights
        lib = native.kernels()
        panels = lib is not None and lib.lib.kvk_panel_bytes(int(Q.Q4_K), 16, 256) >= 0
        q4k = next(line for line in plan.lines if line.ggml_type == "Q4_K")
        assert plan.held_bytes == plan.file_bytes + (q4k.file_bytes // 144 * 4 if panels else 0)
    else:
        assert lines_of(plan) == {
            ("Q4_K", "int4-g32"): ("kept", 10),
            ("Q6_K", "bfloat16"): ("dequantized", 4),  # linear weights no kernel keeps: bfloat16
            ("Q6_K", "float32"): ("dequantized", 1),  # the embedding, in the load dtype
            ("F32", "float32"): ("dequantized", 5),
        }
        q4k = next(line for line in plan.lines if line.ggml_type == "Q4_K")
        # int4 groups of 32: half a byte a weight and a bfloat16 scale and zero per group
        assert q4k.held_bytes == q4k.file_bytes // 144 * 256 * 5 // 8
    assert plan.head_copy_bytes == 0  # the head reads the embedding's storage: one copy
    plan = gguf_plan.plan_file(untied, "bfloat16")
    assert lines_of(plan)[("Q8_0", "q8_0")] == ("kept", 1)  # the embedding's blocks, rows looked up
    head = ("Q6_K", "q6_k") if kernels == "kvk" else ("Q6_K", "bfloat16")
    assert lines_of(plan)[head] == ("kept" if kernels == "kvk" else "dequantized", 1)
    # the transformers path: every tensor in the dtype
    kinds = {kind for kind, _ in lines_of(gguf_plan.plan_file(untied, "float32", native=False)).values()}
    assert kinds == {"dequantized"}


def start(source: str) -> tuple[Engine, ModelLoaded, MemorySample]:
    """An engine loaded from `source`, still running, and its first events."""
    events: list = []
    engine = Engine(
        EngineConfig(model=ModelSpec(source, "float32", "cpu"), kv_budget_bytes=POOL), sink=events.append
    )
    engine.start()
    if engine.wait_until_loaded(600) is None:
        engine.shutdown()
        pytest.fail(f"{source} did not load: {engine.load_error}")
    loaded = next(e for e in events if isinstance(e, ModelLoaded))
    memory = next(e for e in events if isinstance(e, MemorySample))
    return engine, loaded, memory


def release(engine: Engine) -> None:
    """As the app replaces an engine: stopped, its model collected, the freed memory handed back
    (the caller holds no other reference)."""
    engine.shutdown()
    del engine
    gc.collect()
    give_back_freed_memory()


def load(source: str) -> tuple[ModelLoaded, MemorySample]:
    engine, loaded, memory = start(source)
    release(engine)
    return loaded, memory


def assert_close(estimated: int, measured: int, what: str, tolerance: float = TOLERANCE) -> None:
    assert abs(estimated - measured) <= tolerance * measured, (
        f"{what}: estimated {estimated / MIB:.1f} MiB, measured {measured / MIB:.1f} MiB"
    )


def estimate_then_replace(running: list[Engine], source: str) -> None:
    """As the app does it: the estimate made while the last model runs (the picker reads it when
    the choice changes), then that engine replaced by a load of `source`; the two compared.
    `running` holds the one reference to the running engine: released, nothing else keeps its
    model alive (a caller's variable would, and its weights would count in the next load)."""
    est = inspect_model(source, dtype="float32")
    runtime = runtime_estimate()
    release(running.pop())
    engine, loaded, memory = start(source)
    running.append(engine)
    process = runtime.process_with(est["weight_bytes"], POOL)
    print(  # shown with -s: the figures the app puts side by side
        f"{source}: weights {est['weight_bytes'] / MIB:.1f} -> {loaded.info.weight_bytes / MIB:.1f} MiB, "
        f"process {process / MIB:.0f} -> {memory.process_bytes / MIB:.0f} MiB"
    )
    assert_close(est["weight_bytes"], loaded.info.weight_bytes, f"{source}: weights")
    # the process: the measured runtime beside the planned weights and the pool asked for
    assert_close(process, memory.process_bytes, f"{source}: process", PROCESS_TOLERANCE)


def test_the_weights_estimate_holds_for_k_quant_files(kquant_files, any_tokenizer, kernels):
    for path in kquant_files:
        est = inspect_model(str(path), dtype="float32")
        loaded, _ = load(str(path))
        assert_close(est["weight_bytes"], loaded.info.weight_bytes, path.name)
        assert est["weights_as"] == "native"


@pytest.mark.slow
def test_estimate_and_measured_side_by_side_for_the_packaged_model_and_k_quant_files(
    kquant_files, any_tokenizer
):
    """Weights and the whole process (each within 10%), as the app shows them side by
    side after a load: the packaged model replacing itself (loaded once first, so the runtime is
    this process's, measured), then the K-quant files replacing it."""
    running = [start("default")[0]]
    try:
        estimate_then_replace(running, "default")
        for path in kquant_files:
            estimate_then_replace(running, str(path))
    finally:
        while running:  # a failed comparison leaves no engine thread to the next test
            release(running.pop())


def test_what_of_a_lazy_pool_is_resident_is_measured_not_assumed():
    """A pool that fills lazily holds pages only where blocks were written: the running engine's
    pool counts what is resident now (the runtime is the process less that, not less its size)."""
    import torch

    from engine.model.kv_storage import PagedKVStorage, fills_lazily
    from engine.model.runtime_memory import pool_resident, resident_in

    pool = PagedKVStorage(4, 512, 16, 4, 64, torch.float32, "cpu")  # 4 layers x 8 MiB
    size = sum(t.numel() * t.element_size() for t in pool.kv)
    assert fills_lazily("cpu")
    assert pool_resident(pool) < size // 16  # untouched
    # unwritten slots read as zeros (the torch decode path and the int8 gather read whole held
    # blocks); reading a few blocks makes no more than those resident
    assert int(torch.count_nonzero(pool.kv[1][:, :8])) == 0 and pool_resident(pool) < size // 16
    pool.kv[0][:, :256].fill_(1.0)  # half the blocks of one layer written
    assert abs(pool_resident(pool) - size // 8) <= size // 32
    written = torch.ones(1 << 20)
    assert resident_in([written]) == written.numel() * 4


def test_a_file_s_share_in_the_page_cache_is_asked_of_the_kernel(tmp_path):
    """engine bench says how much of a model file the page cache held as its load began: a file
    just written and read is all there; dropped from the cache (where the kernel drops it: not on
    a tmpfs, whose pages are the file), less of it; nothing to say of an empty or missing file."""
    import os

    from engine.model.runtime_memory import cached_share

    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(4 << 20))
    path.read_bytes()
    assert cached_share(path) == 1.0
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    share = cached_share(path)
    assert share is not None and 0.0 <= share <= 1.0
    if share < 1.0:  # a disk-backed tmp_path: the kernel dropped the clean pages
        assert share < 0.5
    (tmp_path / "empty").write_bytes(b"")
    assert cached_share(tmp_path / "empty") is None and cached_share(tmp_path / "missing") is None
