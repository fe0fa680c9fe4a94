"""``info_now``: a rare INFO line reaches the log file at once behind a buffering handler (as Serve's
throughput mode installs on a replica's ``ray.serve`` logger)."""

import io
import logging
import logging.handlers

from cluster.ingress.disconnect import info_now


def test_info_now_flushes_a_buffering_handler_of_the_logger_or_a_parent():
    written = io.StringIO()
    target = logging.StreamHandler(written)
    buffered = logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.ERROR, target=target)
    parent = logging.getLogger("rdserve_test_parent")
    parent.setLevel(logging.INFO)
    parent.addHandler(buffered)
    child = logging.getLogger("rdserve_test_parent.child")
    try:
        child.info("buffered line")  # plain INFO stays in the 1,000-record buffer
        assert written.getvalue() == ""
        info_now(child, "request %s cancelled by the client", "cmpl-1")
        assert written.getvalue().splitlines() == ["buffered line", "request cmpl-1 cancelled by the client"]
    finally:
        parent.removeHandler(buffered)
