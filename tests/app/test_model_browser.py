"""The model browser against the local Hub server: real search results, a repo's files with the
fit, a download with a byte-level bar handed to the picker, and one-line failures."""

from __future__ import annotations

from app_windows import TINY_REPO as TINY
from hub_server import Fault

from app.models.browser import ModelBrowser
from app.models.picker import ModelPicker
from app.settings import MIB, ModelChoice
from engine.hub.online import OFFLINE_IS_DEFAULT
from engine.model.sources import default_gguf_path
from engine.units import format_bytes


def open_browser(qtbot) -> ModelBrowser:
    browser = ModelBrowser(dtype="float32")
    qtbot.addWidget(browser)
    return browser


def search(qtbot, browser, text: str) -> None:
    browser.query.setText(text)
    browser.search_button.click()
    qtbot.waitUntil(
        lambda: browser.results.rowCount() > 0 or "No text" in browser.status.text(), timeout=30_000
    )


def test_search_files_and_download_to_the_picker(qtbot, hub):
    picker = ModelPicker(ModelChoice(), default_budget_bytes=256 * MIB)
    qtbot.addWidget(picker)
    picker.open_browser()
    browser = picker._browser
    search(qtbot, browser, "kvscope")
    rows = [browser.results.item(r, 0).text() for r in range(browser.results.rowCount())]
    assert rows[0] == TINY and set(rows) == {
        TINY,
        "kvscope-test/tiny-llama-gated",
        "kvscope-test/SmolLM2-GGUF",
        "kvscope-test/tiny-mamba",
        "kvscope-test/docs-only",
    }
    assert browser.results.item(0, 1).text() == "4.2k" and browser.results.item(0, 7).text() == "serves"
    assert browser.results.item(rows.index("kvscope-test/tiny-llama-gated"), 6).text() == "manual"
    # the first result's files, with the fit, before anything downloads
    qtbot.waitUntil(lambda: browser.files_table.rowCount() == 1, timeout=30_000)
    assert browser.files_table.item(0, 0).text() == "safetensors"
    assert browser.files_table.item(0, 4).text().startswith("yes")
    assert browser.files_table.item(0, 2).text() == "–"  # not downloaded yet
    assert browser.support.text() == "kvscope serves it: Llama"
    assert browser.download_button.isEnabled()
    browser.download_button.click()
    qtbot.waitUntil(lambda: browser.use_button.isEnabled(), timeout=60_000)
    assert browser.progress.value() == 1000 and "of" in browser.progress_label.text()
    browser.use_button.click()
    assert picker.choice().source == TINY
    picker.wait_for_estimate()


def test_a_gated_repo_says_what_to_do_in_one_line(qtbot, hub):
    browser = open_browser(qtbot)
    search(qtbot, browser, "gated")
    qtbot.waitUntil(lambda: browser.files_table.rowCount() == 1, timeout=30_000)
    assert "gated" in browser.repo_title.text()
    browser.download_button.click()
    qtbot.waitUntil(lambda: "is gated" in browser.status.text(), timeout=30_000)
    assert "HF_TOKEN" in browser.status.text() and "\n" not in browser.status.text()
    assert browser.download_button.isEnabled() and browser.query.text() == "gated"
    browser.worker.wait()


def test_gguf_files_are_offered_by_quantization(qtbot, hub):
    browser = open_browser(qtbot)
    search(qtbot, browser, "gguf")
    qtbot.waitUntil(lambda: browser.files_table.rowCount() == 1, timeout=30_000)
    assert browser.files_table.item(0, 0).text() == "Q4_1"
    assert browser.download_button.text().startswith("Download Q4_1 (")
    # the fit counts what the load holds, per tensor type from the header, and the runtime beside it
    est = browser._files.choices[0].estimate
    assert "Q4_1 x210 " in browser.files_table.item(0, 3).toolTip()
    process = browser.files_table.item(0, 5)
    assert process.text() == f"≈ {format_bytes(est['process_bytes'])}"
    assert est["process_full_pool_bytes"] == est["process_bytes"] + (
        est["kv_bytes_for_context"] if est["pool_fills_lazily"] else 0
    )
    assert est["process_bytes"] > est["weight_bytes"] + est["runtime_bytes"] // 2
    assert process.toolTip().startswith("once loaded: the runtime ") and "+ weights " in process.toolTip()
    assert browser.results.item(0, 7).text() == "serves"  # its header told, the search hit could not
    browser.worker.wait()


def test_offline_is_one_line_and_keeps_the_query(qtbot, hub, monkeypatch):
    monkeypatch.delenv(OFFLINE_IS_DEFAULT)
    browser = open_browser(qtbot)
    browser.query.setText("llama")
    browser.search_button.click()
    qtbot.waitUntil(lambda: browser.status.text().startswith("Offline"), timeout=30_000)
    assert browser.query.text() == "llama" and browser.status.property("kind") == "error"
    browser.worker.wait()


def select(qtbot, browser, repo_id: str) -> None:
    rows = [browser.results.item(r, 0).text() for r in range(browser.results.rowCount())]
    browser.results.selectRow(rows.index(repo_id))
    qtbot.waitUntil(
        lambda: browser.files_table.rowCount() > 0 or "could not" in browser.repo_title.text(), timeout=30_000
    )


def test_an_architecture_kvscope_refuses_says_why_and_cannot_be_downloaded(qtbot, hub):
    browser = open_browser(qtbot)
    search(qtbot, browser, "kvscope")
    assert (
        browser.results.item(
            [browser.results.item(r, 0).text() for r in range(browser.results.rowCount())].index(
                "kvscope-test/tiny-mamba"
            ),
            7,
        ).text()
        == "refuses"
    )
    select(qtbot, browser, "kvscope-test/tiny-mamba")
    assert browser.support.text().startswith("kvscope refuses it: it is a recurrent (state-space) model")
    assert not browser.download_button.isEnabled()
    select(qtbot, browser, "kvscope-test/docs-only")
    qtbot.waitUntil(lambda: "has no weights kvscope can load" in browser.status.text(), timeout=30_000)
    browser.worker.wait()


def test_a_failed_download_says_so_and_the_next_click_resumes(qtbot, hub, tiny_folder):
    size = (tiny_folder / "model.safetensors").stat().st_size
    hub.faults["model.safetensors"] = Fault(drop_after=size // 2, times=99)
    browser = open_browser(qtbot)
    search(qtbot, browser, "tiny-llama-chat")
    qtbot.waitUntil(lambda: browser.download_button.isEnabled(), timeout=30_000)
    browser.download_button.click()
    qtbot.waitUntil(lambda: "Cannot reach the Hugging Face Hub" in browser.status.text(), timeout=60_000)
    assert browser.download_button.isEnabled() and not browser.cancel_button.isEnabled()
    hub.faults.clear()
    browser.download_button.click()
    qtbot.waitUntil(lambda: browser.use_button.isEnabled(), timeout=60_000)
    assert "resumed" in browser.status.text()
    # the cache tab lists it with its size; deleting frees it
    browser.tabs.setCurrentWidget(browser.cache)
    cache = browser.cache
    cache.confirm_delete = False
    assert cache.table.rowCount() == 1 and cache.table.item(0, 0).text() == TINY
    assert cache.table.item(0, 2).text().endswith("MiB")
    cache.table.selectRow(0)
    cache.delete_button.click()
    assert cache.table.rowCount() == 0 and cache.summary.text().startswith(f"Deleted {TINY}")
    browser.worker.wait()


def test_the_picker_lists_models_on_this_machine_with_size_and_fit(qtbot, hub, tmp_path, monkeypatch):
    home = tmp_path / "home"
    store = home / ".lmstudio" / "models" / "someone" / "SmolLM2-GGUF"
    store.mkdir(parents=True)
    (store / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(default_gguf_path())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "share"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    picker = ModelPicker(ModelChoice(), default_budget_bytes=256 * MIB)
    qtbot.addWidget(picker)
    picker.add_cached_models()  # scanned on a worker: the entry arrives on the GUI thread

    def shown() -> list[str]:
        return [picker.source.itemText(i) for i in range(picker.source.count())]

    qtbot.waitUntil(lambda: any(label.startswith("LM Studio: ") for label in shown()), timeout=60_000)
    labels = shown()
    (entry,) = [label for label in labels if label.startswith("LM Studio: ")]
    assert "SmolLM2-135M-Instruct-Q4_1.gguf · 93.8 MiB" in entry
    index = labels.index(entry)
    qtbot.waitUntil(lambda: picker.source.itemText(index).endswith(" · fits"), timeout=60_000)
    picker.wait_for_estimate()
