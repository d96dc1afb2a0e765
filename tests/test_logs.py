"""Log records stay one line each, whatever text a client put into them."""

from __future__ import annotations

import io
import logging

from outrider.daemon.processes.logs import OneLineFormatter, escape_controls


def test_controls_and_line_breaks_are_escaped() -> None:
    text = "a\nb\rc\x1b[31md\x85e\u2028f\u2029g\x7fh\ti"
    assert escape_controls(text) == "a\\x0ab\\x0dc\\x1b[31md\\x85e\\u2028f\\u2029g\\x7fh\ti"
    assert escape_controls("héllo 日本語") == "héllo 日本語"


def test_a_record_is_one_line_and_its_traceback_indented() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("outrider.test-logs")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("finished id=%s rid=%d", "x\nINFO forged", 3)
        try:
            raise ValueError("bad\nINFO forged too")
        except ValueError:
            log.exception("failed %s", "y\rz")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "WARNING finished id=x\\x0aINFO forged rid=3"
    assert lines[1] == "ERROR failed y\\x0dz"
    assert all(line.startswith("    ") for line in lines[2:]), lines
    assert lines[-2:] == ["    ValueError: bad", "    INFO forged too"]
