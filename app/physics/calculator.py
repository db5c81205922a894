"""The KV memory calculator's questions, answered off the GUI thread: a source's config read
through `inspect_model` (metadata only, on a worker), and the loaded model's shapes with the
memory its device has available now (asked of the engine thread, which owns the device)."""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot

from app.engine_host import EngineHost
from app.workers import Worker, create_worker
from engine.api import inspect_model, kv_bytes_per_token
from engine.config import DTYPES
from engine.events import ModelInfo, ModelLoaded
from widgets.kv_calculator import KVCalculator
from widgets.kv_memory import KVConfig, kv_storage

THREAD_NAME = "kvscope-kv-calculator"


def loaded_config(info: ModelInfo, kv_dtype: str, batch: int, available_bytes: int | None) -> KVConfig:
    """The loaded model in the calculator: its shapes and KV storage at its full context, its
    weights, and as the budget its weights plus the memory still available beside them (no
    budget when that is not known: a remote engine's device)."""
    return KVConfig(
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=kv_storage(info.kv_stored_as("auto"), kv_dtype),
        context=info.max_position_embeddings,
        batch=batch,
        num_heads=info.num_heads,
        weight_bytes=info.weight_bytes,
        budget_bytes=0 if available_bytes is None else info.weight_bytes + available_bytes,
    )


def pool_kv_dtype(loaded: ModelLoaded) -> str:
    """What a pool stores, read from its own size (a remote engine's config is not known here):
    "int8" when its bytes per token are the int8 formula's, else "auto"."""
    info, tokens = loaded.info, loaded.kv_num_blocks * loaded.kv_block_size
    int8 = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, "int8")
    return "int8" if tokens and loaded.kv_pool_bytes == tokens * int8 else "auto"


def inspected_config(est: dict, kv_choice: str, batch: int) -> KVConfig:
    """inspect_model's figures for a source, with the KV stored as the user chose."""
    return KVConfig(
        num_layers=est["num_layers"],
        num_kv_heads=est["num_kv_heads"],
        head_dim=est["head_dim"],
        dtype=kv_choice,
        context=est["context"],
        batch=batch,
        num_heads=est["num_heads"],
        weight_bytes=est["weight_bytes"],
        # inspect_model's budget is the memory available now, weights not yet loaded.
        budget_bytes=est["budget_bytes"],
    )


class CalculatorController(QObject):
    def __init__(self, host: EngineHost, calculator: KVCalculator, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host, self.calculator = host, calculator
        self.worker: Worker | None = None
        calculator.inspect_requested.connect(self.inspect)
        calculator.loaded_requested.connect(self.fill_loaded)
        host.model_loaded.connect(self._on_model_loaded)

    @Slot(object)
    def _on_model_loaded(self, _event: ModelLoaded) -> None:
        if self.calculator.follows_loaded:  # unless the user has typed a config of their own
            self.fill_loaded()

    @Slot()
    def fill_loaded(self) -> None:
        loaded, config = self.host.live.loaded, self.host.config
        if loaded is None:
            self.calculator.show_error("No model is loaded yet.")
            return
        info = loaded.info
        kv_dtype = config.kv_dtype if config is not None else pool_kv_dtype(loaded)
        batch = self.calculator.batch.value()

        call = self.host.ask(lambda engine: engine.device(), name="available memory")
        call.returned.connect(
            lambda device: self.calculator.show_loaded(
                loaded_config(info, kv_dtype, batch, device.available_bytes)
            )
        )
        call.errored.connect(
            lambda message: self._without_memory(loaded_config(info, kv_dtype, batch, None), message)
        )

    def _without_memory(self, config: KVConfig, message: str) -> None:
        """The shapes are known, the memory beside them is not: no budget, and why."""
        self.calculator.show_loaded(config)
        self.calculator.show_error(f"The memory available for this model is not known here: {message}")

    @Slot(str, str)
    def inspect(self, source: str, kv_choice: str) -> None:
        dtype = kv_choice if kv_choice in DTYPES else "float32"  # int8 KV: weights as loaded, float32
        batch = self.calculator.batch.value()

        def read() -> dict:
            return inspect_model(source, dtype=dtype)

        self.worker = create_worker(
            read,
            name=THREAD_NAME,
            parent=self,
            on_returned=lambda est: self.calculator.show_inspected(inspected_config(est, kv_choice, batch)),
            on_errored=lambda message: self.calculator.show_error(f"Cannot read that model: {message}"),
        )

    def shutdown(self, timeout: float) -> bool:
        return all(worker.wait(timeout) for worker in self.findChildren(Worker))
