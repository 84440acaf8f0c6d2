"""The standard AWS credential chain for the S3 store, as the AWS CLI and boto3 follow it:

1. the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), read by
   obstore itself;
2. a profile: AWS_PROFILE (else "default") in the shared credentials and config files
   (~/.aws/credentials, ~/.aws/config, or AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE): static
   keys, SSO, credential_process and assume-role profiles;
3. web identity, the container's credentials, the instance's metadata.

obstore (0.12) reads the environment and the third group but no profile or shared file, so from
the second step on botocore resolves the chain and hands obstore its credentials through a
credential provider (refreshed as botocore refreshes them). Without botocore, a profile cannot be
read: AWS_PROFILE is then refused, and obstore's own chain (1 and 3) is used.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Callable

# obstore asks a provider again once its answer expires; botocore refreshes temporary credentials
# shortly before they end, so a few minutes keep obstore within botocore's validity.
_REASK = datetime.timedelta(minutes=5)
_NONE_FOUND = ("no AWS credentials found: not in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), "
               "not in a profile (AWS_PROFILE, ~/.aws/credentials, ~/.aws/config), nor from web identity, "
               "the container or the instance metadata")


@dataclass
class AwsCredentials:
    """provider: obstore's credential_provider, or None (obstore reads the environment and its own
    chain). region: the profile's region where the environment names none. missing: why no
    credentials were found, if none were. secrets(): the credential values in use, to keep out
    of error text."""

    provider: Callable | None = None
    region: str | None = None
    missing: str | None = None
    secrets: Callable[[], list] = field(default=lambda: [])


class _BotocoreProvider:
    """obstore's credential_provider over botocore's resolved credentials."""

    def __init__(self, credentials):
        from botocore.credentials import RefreshableCredentials
        self._credentials = credentials
        self._refreshable = isinstance(credentials, RefreshableCredentials)
        self._last = credentials.get_frozen_credentials()

    def __call__(self) -> dict:
        self._last = self._credentials.get_frozen_credentials()  # botocore refreshes here when due
        expires = datetime.datetime.now(datetime.timezone.utc) + _REASK if self._refreshable else None
        return {"access_key_id": self._last.access_key, "secret_access_key": self._last.secret_key,
                "token": self._last.token, "expires_at": expires}

    def secrets(self) -> list:
        return [self._last.secret_key, self._last.token]


def _environment_secrets() -> list:
    return [os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def resolve_aws_credentials() -> AwsCredentials:
    """Where this process's S3 credentials come from (see the module's docstring). Raises
    PermissionError naming the profile when AWS_PROFILE cannot be used."""
    env = os.environ
    if (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")) or _truthy(env.get("AWS_SKIP_SIGNATURE")):
        return AwsCredentials(secrets=_environment_secrets)
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        if env.get("AWS_PROFILE"):
            raise PermissionError(f"AWS_PROFILE={env['AWS_PROFILE']!r} is set, but reading a profile needs "
                                  "botocore: pip install botocore") from None
        return AwsCredentials(secrets=_environment_secrets)
    session = botocore.session.Session()
    try:
        credentials = session.get_credentials()
    except botocore.exceptions.ProfileNotFound:
        raise PermissionError(f"AWS_PROFILE={env.get('AWS_PROFILE')!r} is not a profile in the shared "
                              "credentials or config file (~/.aws/credentials, ~/.aws/config, or "
                              "AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE)") from None
    except botocore.exceptions.BotoCoreError as e:  # an SSO token expired, a credential_process failed...
        raise PermissionError(f"the AWS profile {session.profile or 'default'!r} gave no credentials: "
                              f"{type(e).__name__}: {e}") from None
    region = None if env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") else session.get_config_variable("region")
    if credentials is None:
        return AwsCredentials(region=region, missing=_NONE_FOUND, secrets=_environment_secrets)
    provider = _BotocoreProvider(credentials)
    return AwsCredentials(provider=provider, region=region, secrets=provider.secrets)
