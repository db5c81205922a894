"""What a native load holds for each tensor of a GGUF file, written once: the loader
(engine/model/gguf_native.py) decides through `keeping_for` what it keeps, and every fit estimate
(inspect-model, the model picker, the Hub's file list) sums the same `holding`s, so an estimate is
what the load does.

A tensor's holding follows its GGML type and its role in the model:
  linear     a 2-D weight of a linear layer (the LM head among them)
  embedding  the token embedding's table (rows looked up)
  other      norms, biases, anything else
`RULES` lists, per GGML type, the storages that can keep it at its own bits, in order: the first
one available here (the kvk C kernels, or torch's packed layouts without them) and covering the
role keeps it, and says what it holds in bytes and how it is built. A type or a role no storage
keeps is dequantized: a linear weight of a quantized type to bfloat16 (never float32), anything
else to the load dtype. `HEAD_COPIES` says which head storages get a second copy for the pass
over the vocabulary (none today: the head computes every logit from the file's blocks). To keep a
new type, add its rule (and its storage in engine/kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.kernels import gguf_blocks, native
from engine.kernels.gguf_weight import KVK_TYPES, GGUFWeight
from engine.model.configs import gguf_header
from engine.shapes import DTYPE_BYTES
from engine.units import format_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from engine.kernels.native import Kvk
    from engine.kernels.weights import WeightStorage
    from engine.model.gguf_header import GGUFHeader

LINEAR, EMBEDDING, OTHER = "linear", "embedding", "other"
KEPT, DEQUANTIZED = "kept", "dequantized"
GROUP = 32  # the int4 storage's group and the Q8_0 block: 32 input columns
# Tensors of a GGUF that a load does not hold: rotary frequencies, which the model computes itself.
NOT_HELD_PREFIXES = ("rope_",)
# The token embedding's name in every architecture gguf-py maps.
EMBEDDING_TENSOR = "token_embd.weight"
HEAD_TENSOR = "output.weight"
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# A linear weight of a quantized type no storage keeps (IQ1/IQ2/IQ3, TQ, or a K-quant without kvk)
DEQUANTIZED_LINEAR = "bfloat16"

# (raw tensor data, type, cols, row order or None, the kvk library or None) -> the storage
Builder = Callable[
    ["np.ndarray", GGMLQuantizationType, int, "np.ndarray | None", "Kvk | None"], "WeightStorage"
]


def file_bytes(qtype: GGMLQuantizationType, rows: int, cols: int) -> int:
    """The tensor's bytes in the file: what a storage holding its blocks (memory-mapped) holds."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return rows * (cols // block) * nbytes


def int4_g32_bytes(rows: int, cols: int) -> int:
    """torch's packed int4 layout: half a byte per code, a bfloat16 scale and zero per 32 columns.
    (Rows pad to the packed layout's block of 32-64 rows; no projection kvscope fuses needs it.)"""
    return rows * cols // 2 + rows * (cols // GROUP) * 2 * 2


def q8_0_bytes(rows: int, cols: int) -> int:
    """GGUF Q8_0 in Q8BlockWeight: an int8 code per weight, a float16 scale per 32 (34 bytes)."""
    return rows * cols + rows * (cols // GROUP) * 2


def _build_kvk(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, order: np.ndarray | None, kvk: Kvk | None
) -> WeightStorage:
    blocks = raw.view(np.uint8).reshape(raw.shape[0], -1)  # F16/BF16 arrive as 16-bit values
    return GGUFWeight(qtype, blocks, cols, order, kvk)


def _build_int4(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, order: np.ndarray | None, kvk: Kvk | None
) -> WeightStorage:
    return gguf_blocks.int4_storage(raw, qtype, cols, order)


def _build_q8_0(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, order: np.ndarray | None, kvk: Kvk | None
) -> WeightStorage:
    return gguf_blocks.q8_storage(raw, cols, order)


@dataclass(frozen=True, slots=True)
class Keeping:
    """One way native loading keeps a GGML type at its own bits."""

    storage: str  # the storage's kind (engine.kernels): what the kernel table and the notes name
    roles: frozenset[str]  # LINEAR, EMBEDDING: where it keeps the type
    with_kvk: bool  # True: needs the kvk kernels; False: the path without them
    held_bytes: Callable[[GGMLQuantizationType, int, int], int]  # (type, rows, cols) -> bytes held
    build: Builder
    how: str  # what keeping means here, for the notes

    def available(self, kvk: Kvk | None) -> bool:
        return (kvk is not None) == self.with_kvk


_BOTH = frozenset({LINEAR, EMBEDDING})


def _kvk(qtype: GGMLQuantizationType) -> Keeping:
    return Keeping(
        qtype.name.lower(),
        _BOTH,
        True,
        file_bytes,
        _build_kvk,
        "the file's blocks, memory-mapped, multiplied by kvk",
    )


def _int4(how: str) -> Keeping:
    return Keeping(
        "int4-g32",
        frozenset({LINEAR}),
        False,
        lambda q, rows, cols: int4_g32_bytes(rows, cols),
        _build_int4,
        how,
    )


# the types the kvk kernels multiply by (engine.kernels.gguf_weight, the kernel's own list)
RULES: dict[GGMLQuantizationType, tuple[Keeping, ...]] = {
    qtype: (_kvk(qtype),) for qtype in sorted(KVK_TYPES)
}
# without kvk: torch's packed int4 layout holds the 4-bit types' codes exactly; Q8_0 its blocks
for _name, _how in (
    ("Q4_0", "4-bit codes exact, scales in bfloat16 (torch's int4 layout)"),
    ("Q4_1", "4-bit codes exact, scales and mins in bfloat16 (torch's int4 layout)"),
    ("Q4_K", "4-bit codes exact, each 32-group's scale and min in bfloat16 (torch's int4 layout)"),
):
    RULES[GGMLQuantizationType[_name]] += (_int4(_how),)
RULES[GGMLQuantizationType.Q8_0] += (
    Keeping(
        "q8_0",
        _BOTH,
        False,
        lambda q, rows, cols: q8_0_bytes(rows, cols),
        _build_q8_0,
        "the blocks as they are",
    ),
)


def keeping_for(ggml_type: int, role: str, kvk: Kvk | None) -> Keeping | None:
    """The storage that keeps a tensor of `ggml_type` in `role` here (`kvk`: the C kernels, None
    without them), or None: it is dequantized."""
    for keeping in RULES.get(GGMLQuantizationType(ggml_type), ()):
        if role in keeping.roles and keeping.available(kvk):
            return keeping
    return None


def kvk_here() -> Kvk | None:
    """The kvk kernels of this machine (built once when a compiler is there), as a load finds them."""
    return native.kernels()


# The LM head's storage kind -> the bytes of an extra copy its pass over the vocabulary runs on
# (engine.kernels.linear.KernelHead). None today: the head computes every logit from the file's
# blocks (kvk) or the blocks it holds; a storage that wants a faster copy adds itself here.
HEAD_COPIES: dict[str, Callable[[int, int], int]] = {}


def makes_head_copy(storage: str) -> bool:
    return storage in HEAD_COPIES


@dataclass(frozen=True, slots=True)
class Holding:
    kind: str  # KEPT or DEQUANTIZED
    held_as: str  # the storage kind, or the dtype it was dequantized to
    held_bytes: int


def holding(
    ggml_type: int, role: str, shape: tuple[int, ...], dtype: str, kvk: Kvk | None, head: bool = False
) -> Holding:
    """What a native load holds for a tensor of `ggml_type` in `role`, of `shape` in the model's
    order ([rows, cols]: GGUF lists them the other way round), loaded in `dtype`; `head`: the LM
    head's tensor (never repacked: its exact pass reads the file's rows)."""
    qtype = GGMLQuantizationType(ggml_type)
    keeping = keeping_for(qtype, role, kvk) if len(shape) == 2 else None
    if keeping is not None:
        held = keeping.held_bytes(qtype, *shape)
        if kvk is not None and role == LINEAR and not head and keeping.with_kvk:
            # a linear layer's rows in panels where this build has them (GGUFWeight.use_panels)
            panels = int(kvk.lib.kvk_panel_bytes(int(qtype), shape[0], shape[1]))
            held = panels if panels >= 0 else held
        return Holding(KEPT, keeping.storage, held)
    to = DEQUANTIZED_LINEAR if role == LINEAR and qtype not in FLOAT_TYPES else dtype
    return Holding(DEQUANTIZED, to, math.prod(shape) * DTYPE_BYTES[to])


# ---- a whole file ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # the model's order: [rows, cols] for a matrix
    file_bytes: int


def entry_from_gguf(name: str, ggml_type: int, gguf_shape: Iterable[int]) -> TensorEntry:
    """A tensor as a GGUF's header lists it (shape innermost first), with its bytes in the file."""
    shape = tuple(int(d) for d in reversed(list(gguf_shape)))
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return TensorEntry(name, int(ggml_type), shape, math.prod(shape) // block * nbytes)


def role_of(name: str, ndim: int) -> str:
    """The tensor's role read from its GGUF name (the loader reads it from the module instead)."""
    if name == EMBEDDING_TENSOR:
        return EMBEDDING
    if ndim == 2 and name.endswith(".weight") and "norm" not in name:
        return LINEAR
    return OTHER


@dataclass(frozen=True, slots=True)
class TypeLine:
    """The tensors of one GGML type that a load holds alike."""

    ggml_type: str
    kind: str
    held_as: str
    tensors: int
    file_bytes: int
    held_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFPlan:
    dtype: str
    native: bool
    lines: tuple[TypeLine, ...]
    head_copy_bytes: int  # the LM head's extra copy (HEAD_COPIES), 0 when it has none

    @property
    def held_bytes(self) -> int:
        return sum(line.held_bytes for line in self.lines) + self.head_copy_bytes

    @property
    def file_bytes(self) -> int:
        return sum(line.file_bytes for line in self.lines)

    def summary(self) -> str:
        """One line: each type, how it is held and its bytes, then the head's copy."""
        parts = [
            f"{line.ggml_type} x{line.tensors} "
            + (f"kept as {line.held_as}" if line.kind == KEPT else f"in {line.held_as}")
            + f" {format_bytes(line.held_bytes)}"
            for line in self.lines
        ]
        if self.head_copy_bytes:
            parts.append(f"the head's extra copy {format_bytes(self.head_copy_bytes)}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "native": self.native,
            "held_bytes": self.held_bytes,
            "file_bytes": self.file_bytes,
            "head_copy_bytes": self.head_copy_bytes,
            "types": [
                {
                    "type": line.ggml_type,
                    "held": line.kind,
                    "as": line.held_as,
                    "tensors": line.tensors,
                    "file_bytes": line.file_bytes,
                    "held_bytes": line.held_bytes,
                }
                for line in self.lines
            ],
        }


def plan_entries(entries: Iterable[TensorEntry], dtype: str, native: bool = True) -> GGUFPlan:
    """What a load of these tensors holds: natively (`native`: RULES keep what they cover, with
    the kernels this machine has) or dequantized to `dtype` throughout (the transformers path),
    the LM head's copy included."""
    entries = [e for e in entries if not e.name.startswith(NOT_HELD_PREFIXES)]
    kvk = kvk_here() if native else None
    held: dict[tuple[str, str, str], list[int]] = {}
    by_name: dict[str, Holding] = {}
    for entry in entries:
        if native:
            role = role_of(entry.name, len(entry.shape))
            h = holding(entry.ggml_type, role, entry.shape, dtype, kvk, head=entry.name == HEAD_TENSOR)
        else:  # transformers dequantizes every tensor to the load dtype
            h = Holding(DEQUANTIZED, dtype, math.prod(entry.shape) * DTYPE_BYTES[dtype])
        by_name[entry.name] = h
        key = (GGMLQuantizationType(entry.ggml_type).name, h.kind, h.held_as)
        counts = held.setdefault(key, [0, 0, 0])
        counts[0] += 1
        counts[1] += entry.file_bytes
        counts[2] += h.held_bytes
    lines = tuple(
        TypeLine(name, kind, held_as, n, file_bytes, held_bytes)
        for (name, kind, held_as), (n, file_bytes, held_bytes) in sorted(
            held.items(), key=lambda kv: -kv[1][2]
        )
    )
    # the head: the file's output tensor, else the embedding it is tied to (one tensor, one storage)
    head_name = HEAD_TENSOR if HEAD_TENSOR in by_name else EMBEDDING_TENSOR
    head = by_name.get(head_name)
    shape = next((e.shape for e in entries if e.name == head_name), None)
    copy = 0
    if head is not None and shape is not None and head.kind == KEPT and makes_head_copy(head.held_as):
        copy = HEAD_COPIES[head.held_as](*shape)
    return GGUFPlan(dtype, native, lines, copy)


def plan_header(header: GGUFHeader, dtype: str, native: bool = True) -> GGUFPlan:
    """The plan of the GGUF file whose header this is (a local file's, or one on the Hub read
    over range requests before any download)."""
    return plan_entries((entry_from_gguf(t.name, t.ggml_type, t.dims) for t in header.tensors), dtype, native)


def plan_file(path: Path, dtype: str, native: bool = True) -> GGUFPlan:
    """The plan of a local GGUF file (its lean header, read once: engine.model.configs.gguf_header,
    the one the loader reads too)."""
    return plan_header(gguf_header(path), dtype, native)
