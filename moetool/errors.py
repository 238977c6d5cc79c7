"""The one exception type users see, printed by the CLI as a single line."""
from __future__ import annotations


class MoetoolError(Exception):
    """A user-facing error: the message is one line naming the file, tensor or option at fault.

    The CLI prints ``error: <message>`` and exits with status 2. Set ``MOETOOL_TRACEBACK=1``
    for the full traceback.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


#: what ``json.loads`` raises on a file that is not the JSON it should be: JSONDecodeError and
#: UnicodeDecodeError (both ValueErrors), an integer past Python's digit limit (ValueError),
#: nesting past the recursion limit (RecursionError)
JSON_ERRORS = (ValueError, RecursionError)


class VerificationFailed(MoetoolError):
    """Verification ran but at least one layer was outside its tolerance (exit status 1)."""

    exit_code = 1


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the command (raised in the main thread by the CLI's signal
    handler). A BaseException, like KeyboardInterrupt, so no ``except Exception`` swallows it;
    the CLI prints ``error: interrupted`` and exits with 128 + the signal number (130, 143).
    Outputs are left visibly unfinished (no manifest) and a re-run resumes."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
