"""Object stores: what a client's error message says (a refusal, a timeout, whose
refusal), read without the URLs, addresses and durations in it."""

from __future__ import annotations

import re

__all__ = ["ATTEMPTS", "DENIED", "NOISE", "NOT_ACCEPTED", "UNIT_S", "credentials_refused",
           "scrub"]


#: what a store's message holds besides its status and error code: URLs (with the
#: bucket, key and port), addresses, obstore's ``path: "..."`` and durations; a
#: status looked for in them would be found in ``127.0.0.1:40371`` or ``1.403ms``
NOISE = re.compile(
    r"[a-z][a-z0-9+.-]*://[^\s,)\"']*"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"
    r"|\bpath:?\s*\"[^\"]*\""
    r"|\bfor path \S+"
    r"|\b\d+(?:\.\d+)?\s*(?:ms|\u00b5s|us|ns|s)\b",
    re.IGNORECASE)
#: a refusal (403) in a scrubbed, lower-cased message
DENIED = re.compile(r"status(?: code)?:?\s*403\b|\b403\s+forbidden|\bforbidden\b|accessdenied")


#: obstore's message of a failed request: "Error performing PUT <url> in 4.1s, after 1
#: retries, ... - HTTP error: error sending request" (no "after" without retries)
ATTEMPTS = re.compile(r"Error performing [A-Z]+ \S+ in (\d+(?:\.\d+)?)(s|ms|\u00b5s|us|ns)"
                      r"(?:, after (\d+) retries)?[^\n]*error sending request")
UNIT_S = {"s": 1.0, "ms": 1e-3, "\u00b5s": 1e-6, "us": 1e-6, "ns": 1e-9}


#: what marks a 403 that refuses the credentials themselves (a wrong key or secret, an
#: expired token), not a permission they lack: error codes, and the message Azure and
#: Azurite give a bad signature (Azurite's code is AuthorizationFailure, which Azure
#: uses for network rules); looked for lower case, without spaces
NOT_ACCEPTED = {"<code>authenticationfailed</code>": "AuthenticationFailed",
                "serverfailedtoauthenticatetherequest": "the signature was refused",
                "<code>signaturedoesnotmatch</code>": "SignatureDoesNotMatch",
                "<code>invalidaccesskeyid</code>": "InvalidAccessKeyId",
                "<code>expiredtoken</code>": "ExpiredToken",
                "<code>invalidtoken</code>": "InvalidToken"}


def credentials_refused(exc: BaseException) -> str | None:
    """What says that ``exc`` refuses the credentials themselves, else None (a fixed
    label: nothing of the message is returned, so it is read unredacted, as
    the redaction of secrets would hide ``SignatureDoesNotMatch`` as a ``Signature=``)."""
    squashed = str(exc).lower().replace(" ", "")
    return next((name for mark, name in NOT_ACCEPTED.items() if mark in squashed), None)


def scrub(text: str) -> str:
    """``text`` without what may hold digits or words by chance (see :data:`NOISE`)."""
    return NOISE.sub(" ", text)
