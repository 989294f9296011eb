"""What reading a column at a narrower type changed: counted per column, merged across batches, named in the report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CastNote:
    """What reading one column's float64 values as float32 changed (:func:`parity.records.validate.validate_batch`)."""

    column: str
    source_type: str
    target_type: str
    values: int = 0
    changed: int = 0  # values the cast did not keep exactly
    overflowed: int = 0  # of them, finite values that became +-inf
    max_change: float = 0.0  # largest |change| among the others

    def merge(self, o: CastNote) -> None:
        self.values += o.values
        self.changed += o.changed
        self.overflowed += o.overflowed
        self.max_change = max(self.max_change, o.max_change)

    def message(self, source: str) -> str:
        out = (f"{source} column {self.column}: {self.source_type} values read as {self.target_type} changed "
               f"{self.changed} of {self.values} value(s) (largest change {self.max_change:.3g})")
        if self.overflowed:
            out += f"; {self.overflowed} finite value(s) became infinite"
        return out + f": write {self.column} as {self.target_type} to analyse the values themselves"
