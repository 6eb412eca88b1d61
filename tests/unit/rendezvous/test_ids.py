"""A job's identity maps to its rendezvous id one-to-one: two different identities never meet."""

import re
import unicodedata

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from trainpod.rendezvous import ids

# Any printable text: what ids.check() keeps (it refuses control, format, private-use and unassigned characters).
printable = st.text(st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), min_size=1, max_size=40)
SAFE = re.compile(r"[A-Za-z0-9._~@-]+")  # a segment of a URL path as python-etcd sends it, unquoted (RFC 3986 pchar)


@pytest.mark.parametrize("identity,escaped", [
    ("team-a", "team-a"), ("team/a", "team@2Fa"), ("team a", "team@20a"), ("team_a", "team_a"), ("a~b", "a~b"), ("a@b", "a@40b"),
    ("Zürich", "Z@C3@BCrich"), ("slurm-42-s0", "slurm-42-s0"), ("..", ".."),
])  # fmt: skip
def test_escape_keeps_what_is_safe_and_escapes_the_rest(identity, escaped):
    assert ids.escape(identity) == escaped
    assert ids.unescape(escaped) == identity


def test_the_issues_four_jobs_stay_four():
    jobs = ["team/a", "team-a", "team a", "team_a"]
    assert len({ids.escape(job) for job in jobs}) == 4


@pytest.mark.slow
@given(printable)
def test_escape_is_reversible_and_safe_in_keys_and_urls(identity):
    assume(len(ids._escape(identity)) <= ids.MAX_LENGTH)
    escaped = ids.escape(identity)
    assert ids.unescape(escaped) == identity
    assert SAFE.fullmatch(escaped)


@given(printable, printable)
def test_two_different_identities_never_share_an_id(first, second):
    assume(first != second and max(len(ids._escape(first)), len(ids._escape(second))) <= ids.MAX_LENGTH)
    assert ids.escape(first) != ids.escape(second)


@given(printable, printable, st.integers(0, 10**6), st.integers(0, 10**6))
def test_with_a_generation_two_runs_never_share_a_rendezvous(first, second, gen_a, gen_b):
    from trainpod.rendezvous.generation import run_id

    assume((first, gen_a) != (second, gen_b))
    assume(max(len(ids._escape(first)), len(ids._escape(second))) <= ids.MAX_LENGTH)
    assert run_id(ids.escape(first), gen_a) != run_id(ids.escape(second), gen_b)


@pytest.mark.parametrize("bad,says", [
    ("team\na", "a newline"), ("a\tb", "a tab"), ("a\x00b", "U+0000"), ("a\u200bb", "zero width space"),
    ("a\u2028b", "U+2028"), ("", "non-empty"), ("x" * (ids.MAX_LENGTH + 1), f"at most {ids.MAX_LENGTH}"),
    ("/" * 70, f"at most {ids.MAX_LENGTH}"),  # 210 characters once escaped
])  # fmt: skip
def test_what_cannot_be_kept_is_refused_in_one_line(bad, says):
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        ids.escape(bad)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
@given(st.text(min_size=1, max_size=20))
def test_any_text_is_escaped_or_refused_never_a_crash(text):
    try:
        escaped = ids.escape(text)
    except ValueError:
        assert any(unicodedata.category(c) in ids._INVISIBLE for c in text) or len(ids._escape(text)) > ids.MAX_LENGTH
    else:
        assert ids.unescape(escaped) == text


def test_a_digest_is_the_same_for_the_same_job_only():
    assert ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"]) == ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"])
    assert ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"]) != ids.digest_id(["etcd-v3", "e:2379", "1:3", "cifar"])
