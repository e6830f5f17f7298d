"""``diff --map OLD=NEW``: rename rules for A's tensor names, matched in linear time.

``*`` in OLD matches any text (dots included); each ``*`` in NEW takes what the
OLD ``*`` at the same place matched, so ``model.*=*`` drops a prefix. The first
rule that matches a name renames it.

A glob of ``*`` and literal text is matched without backtracking: the literal
pieces between the stars are placed from the right, each at its last occurrence
before the piece after it (the last piece ends the name, the first starts it).
That is one search per piece, so a 5,000-character name costs as much as reading
it a few times, where a regex of ``(.*)`` groups takes minutes. The placement
gives the same text to each ``*`` as the regex would: every piece as far right as
it can go makes each ``*`` as long as it can be, the first one first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RenameRule:
    """One ``OLD=NEW`` rule: ``text`` as given, ``pieces`` the literal text of OLD between its stars."""

    text: str
    old: str
    new: str
    pieces: tuple[str, ...]

    def captures(self, name: str) -> list[str] | None:
        """What each ``*`` of OLD matched in ``name`` (None: OLD does not match it)."""
        pieces = self.pieces
        first, last = pieces[0], pieces[-1]
        if len(pieces) == 1:
            return [] if name == first else None
        if not name.startswith(first) or len(name) < len(first) + len(last) or not name.endswith(last):
            return None
        # Place the middle pieces from the right: each ends at or before where the next one starts.
        end = len(name) - len(last)
        starts = [end]
        for piece in reversed(pieces[1:-1]):
            start = name.rfind(piece, len(first), end)
            if start < 0:
                return None
            starts.append(start)
            end = start
        starts.reverse()
        ends = [len(first)] + [s + len(p) for s, p in zip(starts[:-1], pieces[1:-1])]
        return [name[e:s] for e, s in zip(ends, starts)]

    def apply(self, name: str) -> str | None:
        """``name`` renamed by this rule (None: the rule does not match it)."""
        captured = self.captures(name)
        if captured is None:
            return None
        taken = iter(captured)
        return "".join(next(taken, "") if c == "*" else c for c in self.new)


def parse_mapping(items: tuple[str, ...] | list[str]) -> list[RenameRule]:
    """``OLD=NEW`` rules; ``*`` in OLD matches any text, and each ``*`` in NEW takes what the
    OLD ``*`` at the same place matched (``model.*=*`` drops a prefix).

    Raises:
        ValueError: an item is not ``OLD=NEW``, or NEW has more ``*`` than OLD.
    """
    rules = []
    for item in items:
        if "=" not in item:
            raise ValueError(f"{item!r} is not OLD=NEW")
        old, new = item.split("=", 1)
        old, new = old.lstrip("/"), new.lstrip("/")
        if new.count("*") > old.count("*"):
            raise ValueError(f"{item!r}: NEW has more * than OLD")
        rules.append(RenameRule(item, old, new, tuple(old.split("*"))))
    return rules


def apply_mapping(name: str, rules: list[RenameRule]) -> str:
    """``name`` renamed by the first rule that matches it (unchanged if none does)."""
    for rule in rules:
        renamed = rule.apply(name)
        if renamed is not None:
            return renamed
    return name


# Where a name may be cut into a prefix and the rest: after a dot or a slash, at most this
# many levels deep (module., model.decoder., _orig_mod.module....).
_SEPARATORS = "./"
_LEVELS = 3


def _cuts(name: str) -> list[int]:
    cuts = [0]
    for i, c in enumerate(name):
        if c in _SEPARATORS:
            cuts.append(i + 1)
            if len(cuts) > _LEVELS:
                break
    return cuts


# A hint is offered when it pairs at least this share of the smaller side's names: a rule
# that pairs 1 of 21 (two files of different models sharing a `proj.weight`) is no answer.
HINT_SHARE = 0.5


def suggest_mapping(names_a: list[str], names_b: list[str]) -> tuple[str, int] | None:
    """The ``PREFIX_A*=PREFIX_B*`` rule that pairs the most of A's names with B's (a DDP
    ``module.`` prefix on one side only, ``model.`` against ``transformer.``), and how many
    names it pairs; None when no prefix swap pairs at least half the names of the smaller
    side (:data:`HINT_SHARE`)."""
    rests: dict[str, list[str]] = {}
    for name in names_b:
        for cut in _cuts(name):
            rests.setdefault(name[cut:], []).append(name[:cut])
    counts: dict[tuple[str, str], int] = {}
    for name in names_a:
        seen = set()
        for cut in _cuts(name):
            rest = name[cut:]
            if not rest:
                continue
            for prefix_b in rests.get(rest, ()):
                key = (name[:cut], prefix_b)
                if key != ("", "") and key not in seen:
                    seen.add(key)
                    counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    prefix_a, prefix_b = max(counts, key=lambda k: (counts[k], -len(k[0]) - len(k[1])))
    rule = parse_mapping([f"{prefix_a}*={prefix_b}*"])[0]
    wanted = set(names_b)
    paired = sum(apply_mapping(name, [rule]) in wanted for name in names_a)
    if paired < HINT_SHARE * min(len(names_a), len(names_b)):
        return None
    return rule.text, paired
