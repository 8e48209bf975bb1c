"""A window (or lease) given as a text or an interval (rl_get_window_ms).

A text that is a number alone is milliseconds, read as the bigint form (and
1.5, where such a literal resolved to bigint) reads it: white space around
and a sign included, a fraction refused. interval_in would read the same
text as seconds, a thousand times longer. An infinite interval (PostgreSQL
17) is out of range like any window too long or not positive.
"""

import psycopg
import pytest

from conftest import new_ident

WINDOW_MS = 60000


def window_of(pg, window, type_="text"):
    """The window a sliding log applies: its first unit's reset_ms."""
    return pg.execute("SELECT (rl_sliding(%%s, 5, %%s::%s)).reset_ms" % type_,
                      (new_ident("window"), window)).fetchone()[0]


def error_of(pg, query, params=None):
    with pytest.raises(psycopg.Error) as e:
        pg.execute(query, params).fetchall()
    return e.value.sqlstate, e.value.diag.message_primary


@pytest.mark.parametrize("text", ["60000", " 60000 ", "60000\n", "\t60000", "+60000", "060000",
                                  "\r\n 60000\t"])
def test_a_number_alone_is_milliseconds(pg, text):
    assert window_of(pg, text) == WINDOW_MS


@pytest.mark.parametrize("text", ["60.5", "60.0", ".5", " 60. "])
def test_a_number_with_a_fraction_is_refused_as_the_bigint_form_refuses_it(pg, text):
    as_bigint = error_of(pg, "SELECT rl_sliding_allow(%s, 5, %s::bigint)", (new_ident("window"), text))
    assert as_bigint[0] == "22P02"
    assert error_of(pg, "SELECT rl_sliding_allow(%s, 5, %s::text)", (new_ident("window"), text)) == as_bigint


def test_a_number_with_a_unit_is_an_interval(pg):
    assert window_of(pg, "60 s") == WINDOW_MS
    assert window_of(pg, " 60000 ms ") == WINDOW_MS
    assert window_of(pg, "1 minute") == WINDOW_MS


def test_an_infinite_interval_is_out_of_range(pg):
    if pg.info.server_version < 170000:
        pytest.skip("intervals are finite before PostgreSQL 17")
    too_long = ("22023", "window_ms must be at most 3153600000000 (100 years)")
    not_positive = ("22023", "window_ms must be greater than zero")
    ident = new_ident("window")
    assert error_of(pg, "SELECT rl_fixed_allow(%s, 5, interval 'infinity')", (ident,)) == too_long
    assert error_of(pg, "SELECT rl_fixed_allow(%s, 5, 'infinity')", (ident,)) == too_long
    assert error_of(pg, "SELECT rl_fixed_allow(%s, 5, interval '-infinity')", (ident,)) == not_positive
    assert error_of(pg, "SELECT rl_concurrency_acquire(%s, 1, interval 'infinity')", (ident,))[0] == "22023"
