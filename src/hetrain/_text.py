"""Small helpers for the text hetrain prints (counts with their noun, money with its unit)."""

from __future__ import annotations

#: Unit of the money figures hetrain prints. Cluster files give ``price_per_hour`` in US
#: dollars per hour (docs/model.md §7), so money per iteration is in US dollars.
MONEY_UNIT = "USD"


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """``count`` and ``noun``, the noun in the plural unless ``count`` is 1 or -1:
    ``plural(1, "rank") == "1 rank"``, ``plural(4, "rank") == "4 ranks"``,
    ``plural(2, "bus", "buses") == "2 buses"``."""
    word = noun if abs(count) == 1 else (plural_noun or noun + "s")
    return f"{count} {word}"


def money_per_iteration(value: float) -> str:
    """``0.000124`` -> ``"0.000124 USD/iteration"`` (6 significant digits)."""
    return f"{value:.6g} {MONEY_UNIT}/iteration"


def energy_per_iteration(value: float) -> str:
    """``12.5`` -> ``"12.5 J/iteration"`` (joules, 6 significant digits)."""
    return f"{value:.6g} J/iteration"
