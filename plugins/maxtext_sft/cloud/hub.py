"""The Hugging Face Hub connection: the token (password) and, optionally, a private endpoint.

Connection `huggingface_default` (any secrets backend can supply it): password = the token;
extra `endpoint` = a Hub mirror or private Hub (default: huggingface_hub's own, which honours
the HF_ENDPOINT environment variable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowException
from airflow.sdk.log import mask_secret

if TYPE_CHECKING:
    from huggingface_hub import HfApi


def hf_token(hf_conn_id: str) -> str:
    """The Hugging Face token, masked in every log from here on."""
    token = BaseHook.get_connection(hf_conn_id).password
    if not token:
        raise AirflowException(f"Connection {hf_conn_id!r} has no password: put the Hugging Face token there")
    mask_secret(token)
    return token


class HuggingFaceHubHook(BaseHook):
    """Owns one `huggingface_hub.HfApi` built from the connection."""

    conn_name_attr = "hf_conn_id"
    default_conn_name = "huggingface_default"
    conn_type = "generic"
    hook_name = "Hugging Face Hub"

    def __init__(self, hf_conn_id: str = default_conn_name, **kwargs):
        super().__init__(**kwargs)
        self.hf_conn_id = hf_conn_id
        self._api: HfApi | None = None

    def get_conn(self) -> HfApi:
        if self._api is None:
            from huggingface_hub import HfApi  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

            connection = self.get_connection(self.hf_conn_id)
            endpoint = (connection.extra_dejson or {}).get("endpoint") or None
            self._api = HfApi(endpoint=endpoint, token=hf_token(self.hf_conn_id))
        return self._api
