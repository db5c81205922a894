"""The scripted-run flags --n and --num-beams set the launch's sampling, or explain why not."""

from __future__ import annotations

import pytest

from app.main import group_sampling, parse_args
from engine.config import ConfigError, SamplingParams

SAVED = SamplingParams(temperature=0.6, stop=("###",), n=3)


def test_num_beams_chooses_beam_search_and_what_it_needs():
    params = group_sampling(parse_args(["--prompt", "hi", "--num-beams", "4"]), SAVED)
    assert (params.num_beams, params.n, params.temperature, params.stop) == (4, 1, 0.0, ())


def test_n_chooses_samples_and_no_flag_keeps_the_saved_settings():
    assert group_sampling(parse_args(["--prompt", "hi", "--n", "2"]), SAVED).n == 2
    assert group_sampling(parse_args(["--prompt", "hi"]), SAVED) is SAVED


@pytest.mark.parametrize(
    "flags, message",
    [(["--n", "2", "--num-beams", "2"], "not both"), (["--n", "0"], "must be >= 1")],
)
def test_bad_combinations_are_refused_with_the_engines_message(flags, message):
    with pytest.raises(ConfigError, match=message):
        group_sampling(parse_args(["--prompt", "hi", *flags]), SAVED)
