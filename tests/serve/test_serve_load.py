"""The load run's path, short (the command runs it for ten minutes: python -m engine bench
--serve-load): clients streaming, hanging up, cancelling, stopping at a stop string and asking n samples at once lose
nothing, mix nothing up (every greedy reply equals the one it got alone) and leak no block."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.serve.load import prompt_pool, run_load, table


def test_a_short_load_run_loses_and_mixes_up_nothing(tiny_loaded):
    config = EngineConfig(block_size=4, num_blocks=1024, max_num_seqs=8)
    result = run_load(config, clients=12, duration_s=8.0, loaded=tiny_loaded)
    print(table(result, "tiny-random-llama"))
    assert result.requests > 20 and result.greedy and result.stopped and result.dropped and result.sampled
    assert result.lost == 0 and result.mismatches == 0, result.problems[:5]
    assert result.blocks_leaked == 0
    assert (
        result.ttft_s
        and result.itl_s
        and result.rss_start_mib > 0
        and result.rss_peak_mib >= result.rss_end_mib
    )
    assert 0 < result.tokens <= sum(max_tokens for _, max_tokens in prompt_pool(0)) * result.requests
