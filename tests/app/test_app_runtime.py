"""Process settings for the GUI: one core is left to the GUI thread."""

from __future__ import annotations

import pytest

from app.runtime import gui_torch_threads


@pytest.mark.parametrize("cores, threads", [(None, 1), (1, 1), (2, 1), (8, 7), (64, 63)])
def test_every_core_but_one_for_torch(cores, threads):
    assert gui_torch_threads(cores) == threads
