"""Preallocated numpy columns for long series: a panel draws a whole series with one `setData`."""

from __future__ import annotations

import numpy as np


class RingBuffer:
    """Fixed-capacity float64 columns; `column(name)` is the last rows, oldest first, as a view.

    Every value is written twice (at i and i + capacity), so the newest `len(self)` rows are always
    one contiguous slice: no copy and no reordering when the buffer has wrapped.
    """

    def __init__(self, capacity: int, columns: tuple[str, ...]) -> None:
        assert capacity >= 1 and columns
        self.capacity = capacity
        self.columns = columns
        self._index = {name: i for i, name in enumerate(columns)}
        self._data = np.full((len(columns), 2 * capacity), np.nan)
        self.appended = 0  # rows ever appended; row number n is the n-th append (0-based)

    def __len__(self) -> int:
        return min(self.appended, self.capacity)

    def append(self, **values: float) -> int:
        """Append one row (missing columns are NaN); returns its row number."""
        pos = self.appended % self.capacity
        self._data[:, pos] = np.nan
        for name, value in values.items():
            self._data[self._index[name], pos] = value
        self._data[:, pos + self.capacity] = self._data[:, pos]
        self.appended += 1
        return self.appended - 1

    def holds(self, row: int) -> bool:
        return self.appended - len(self) <= row < self.appended

    def value(self, row: int, name: str) -> float:
        """One value of a row that is still in the buffer."""
        assert self.holds(row), f"row {row} is no longer in the buffer"
        return float(self._data[self._index[name], row % self.capacity])

    def set(self, row: int, name: str, value: float) -> None:
        """Overwrite one value of a row that is still in the buffer."""
        assert self.holds(row), f"row {row} is no longer in the buffer"
        pos = row % self.capacity
        self._data[self._index[name], pos] = value
        self._data[self._index[name], pos + self.capacity] = value

    def column(self, name: str) -> np.ndarray:
        n = len(self)
        end = (self.appended - 1) % self.capacity + self.capacity + 1
        return self._data[self._index[name], end - n : end]

    def clear(self) -> None:
        self._data[:] = np.nan
        self.appended = 0
