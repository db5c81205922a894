"""Control vectors in llama.cpp's GGUF format: read, checked against a model, written.

llama.cpp's `--control-vector FILE` reads one float32 vector per layer, named `direction.N`, and
adds it (times a strength) to the residual stream that decoder layer N (0-based) outputs; it
refuses `direction.0`, and a file's metadata may name the model (`controlvector.model_hint`) and
its layer count (`controlvector.layer_count`). repeng's `export_gguf` writes the same layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import InspectionError, first_line
from engine.inside import ControlVector

HINT = "controlvector.model_hint"
LAYER_COUNT = "controlvector.layer_count"
PREFIX = "direction."


def read_control_vector(path: str | Path) -> ControlVector:
    from gguf import GGMLQuantizationType, GGUFReader  # gguf's reader: only when a file is read

    path = Path(path)
    if not path.is_file():
        raise InspectionError(f"no control vector file at {path}")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same message
        raise InspectionError(f"{path.name} is not a GGUF file ({first_line(exc)})") from None
    found: dict[int, tuple[float, ...]] = {}
    for tensor in reader.tensors:
        if not tensor.name.startswith(PREFIX):
            continue
        try:
            layer = int(tensor.name[len(PREFIX) :])
        except ValueError:
            raise InspectionError(f"{path.name}: tensor {tensor.name!r} names no layer") from None
        if layer <= 0:
            raise InspectionError(
                f"{path.name}: {tensor.name} (llama.cpp's control vectors start at layer 1)"
            )
        if tensor.tensor_type != GGMLQuantizationType.F32:
            raise InspectionError(
                f"{path.name}: {tensor.name} is {tensor.tensor_type.name}; a control vector's directions are F32"
            )
        data = np.asarray(tensor.data, dtype=np.float32)
        if data.ndim != 1 and not (data.ndim == 2 and 1 in data.shape):
            raise InspectionError(f"{path.name}: {tensor.name} has shape {tuple(data.shape)}, not one vector")
        found[layer] = tuple(float(x) for x in data.reshape(-1))
    if not found:
        raise InspectionError(f"{path.name} holds no direction.N tensors: it is not a control vector")
    widths = {len(v) for v in found.values()}
    if len(widths) > 1:
        raise InspectionError(f"{path.name}: its directions have different widths {sorted(widths)}")
    hint = ""
    field = reader.fields.get(HINT)
    if field is not None and field.data:
        hint = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    layers = tuple(sorted(found))
    return ControlVector(path.stem, layers, tuple(found[i] for i in layers), str(path), hint)


def check_control_vector(vector: ControlVector, hidden_size: int, num_layers: int) -> None:
    """InspectionError when `vector` does not fit a model of that width and depth."""
    if vector.width != hidden_size:
        raise InspectionError(
            f"the control vector is {vector.width} wide, but this model's residual stream is {hidden_size}"
        )
    beyond = [layer for layer in vector.layers if not 0 <= layer < num_layers]
    if beyond:
        raise InspectionError(
            f"the control vector has directions for layer {max(beyond)}, but this model has {num_layers} "
            f"layers (0 to {num_layers - 1})"
        )


def write_control_vector(vector: ControlVector, path: str | Path) -> None:
    """`vector` as llama.cpp reads a control vector (its layer 0, which llama.cpp refuses, left out)."""
    from gguf import GGUFWriter  # gguf's writer: only when a file is written

    layers = [(layer, d) for layer, d in zip(vector.layers, vector.directions) if layer > 0]
    if not layers:
        raise InspectionError("the control vector has no direction after layer 0 to write")
    writer = GGUFWriter(str(path), "controlvector")
    writer.add_string(HINT, vector.model_hint)
    writer.add_uint32(LAYER_COUNT, len(layers))
    for layer, direction in layers:
        writer.add_tensor(f"{PREFIX}{layer}", np.asarray(direction, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
