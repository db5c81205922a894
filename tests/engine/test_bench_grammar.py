"""`engine bench --grammar` runs end to end on the tiny model: both runs interleaved, the
grammar's own time counted per token, the libraries compared over the real vocabulary (no
timing is asserted: the numbers are the benchmark's to report)."""

from engine.bench.bench_grammar import DOCUMENTS, _print, bench_libraries, bench_stage


def test_the_stage_benchmark_times_the_grammar_against_itl(tiny_loaded):
    report = bench_stage(tiny_loaded, new_tokens=8, rounds=1, block_size=16)
    assert set(report["itl_median_s"]) == {"plain", "grammar"}
    assert report["grammar_s_per_token"] > 0 and report["grammar_share_of_itl"] > 0
    assert report["vocab_size"] == tiny_loaded.info.vocab_size


def test_the_library_comparison_walks_every_document(tiny_loaded):
    report = bench_libraries(tiny_loaded.tokenizer, tiny_loaded.info.vocab_size, repeats=1)
    ll = report["libraries"]["llguidance"]
    assert set(ll["compile_ms"]) == {name for name, _, _ in DOCUMENTS} and ll["mask"]["median_us"] > 0
    assert set(report["positions"]) == set(ll["compile_ms"])
    lines: list[str] = []
    _print({"libraries": report, "stage": bench_stage(tiny_loaded, 4, 1, 16)}, lines.append)
    assert lines[0].startswith("libraries over a 49,152-token vocabulary") and any(
        "goal < 5%" in line for line in lines
    )
