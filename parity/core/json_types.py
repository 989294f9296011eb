"""JSON values as types: what report.json, records metadata and capture facts hold (engine-free)."""

from typing import TypeAlias

Json: TypeAlias = float | int | str | bool | None | list["Json"] | dict[str, "Json"]
JsonObject: TypeAlias = dict[str, Json]
