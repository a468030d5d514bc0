"""Fixtures shared by the unit tests."""

import logging

import pytest


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def every_log_record(caplog):
    """Every record logged during the test, autopar's from INFO up: those reaching the root
    logger and those of loggers that do not propagate to it (torch gives its loggers stderr
    handlers of their own)."""
    caplog.set_level(logging.INFO, logger="autopar")
    keep = _Keep()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values()
        if isinstance(lg, logging.Logger) and not lg.propagate]
    for lg in loggers:
        lg.addHandler(keep)
    yield keep.records
    for lg in loggers:
        lg.removeHandler(keep)
