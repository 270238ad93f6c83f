"""Stop strings: the streaming matcher agrees with a literal rescan, and its cost
does not grow with the stop strings' length."""
from __future__ import annotations

from hypothesis import given, strategies as st

from ds4ref.serve.text import StopMatcher, TextAssembler


class ByteTokenizer:
    """Token id i is the i-th piece of a fixed list (no specials, no thinking)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.pieces[i].encode() for i in ids)

    def token_to_id(self, token: str):
        return None


def rescan_oracle(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """The former algorithm, verbatim in effect: after each piece, cut at the earliest
    stop string found in the unreleased text, else hold back the longest suffix that
    is a proper prefix of a stop string."""
    answer, sent, out = "", 0, []
    for k, piece in enumerate(pieces + [""]):
        final = k == len(pieces)
        answer += piece
        hits = [i for i in (answer.find(s, sent) for s in stops) if i >= 0]
        if hits:
            answer = answer[:min(hits)]
            out.append(answer[sent:])
            return out, True
        held = 0 if final else max([n for s in stops for n in range(1, len(s))
                                    if answer.endswith(s[:n])], default=0)
        out.append(answer[sent:len(answer) - held])
        sent = max(sent, len(answer) - held)
    return out, False


ALPHABET = "ab\u00e9"  # a small alphabet: lots of partial and overlapping matches
texts = st.text(ALPHABET, min_size=1, max_size=4)


@given(pieces=st.lists(texts, max_size=20), stops=st.lists(texts, min_size=1, max_size=4))
def test_streaming_matcher_agrees_with_a_rescan(pieces, stops):
    asm = TextAssembler(ByteTokenizer(pieces), stops)
    released = []
    for i in range(len(pieces)):
        released.append("".join(d.text for d in asm.push(i)))
        if asm.stopped:
            break
    if not asm.stopped:
        released.append("".join(d.text for d in asm.finish()))
    want, stopped = rescan_oracle(pieces, stops)
    assert (released, asm.stopped) == (want, stopped)


def test_earliest_start_wins_over_earliest_end():
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == 1  # "abcd" starts at 1, before "bc" at 2


def test_matcher_work_per_character_is_bounded():
    """A stop string of 4000 'a's followed by 'b', against a text of 'a's: the held
    prefix grows to 4000, yet feeding a character follows at most a few trie edges
    (counted, not timed)."""
    m = StopMatcher(["a" * 4000 + "b", "a" * 2000 + "c"])
    steps = 0
    fail = m._fail

    class CountingList(list):
        def __getitem__(self, i):
            nonlocal steps
            steps += 1
            return list.__getitem__(self, i)

    m._fail = CountingList(fail)
    for _ in range(6000):
        assert m.feed("a") is None
    assert m.held == 4000
    assert steps <= 2 * 6000
