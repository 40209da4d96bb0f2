"""What a module's `in_background` work (tests/conftest.py) produced, failure included: each
test that reads an outcome raises its failure, so one failed job fails the tests that need it,
not the module's set-up."""


def kept(fn, *args):
    """fn(*args), or the exception it raised (re-raised by `result` in the test that reads it)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - kept for the test that reads it
        return e


def result(outcome):
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
