"""deadline(seconds): a context that raises TimeoutError in the main thread after `seconds` (SIGALRM), so a test of
something that used to hang fails instead of waiting forever. The limit is generous: it bounds a hang, it does not
time anything."""
import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: int):
  def fail(*_):
    raise TimeoutError(f"no answer within {seconds} s")
  old = signal.signal(signal.SIGALRM, fail)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
