"""`s3` backend: any S3-compatible object store through boto3.

Owns: the key layout under `<prefix>/` in the bucket and talking to S3:
  <prefix>/blobs/<2 hex>/<64 hex>   encoded chunk (codec byte + payload)
  <prefix>/meta/<name>              manifests and push/gc markers
Must not touch: bucket creation or policy (operators own the bucket), credentials (boto3's usual
chain: environment, shared config/credentials files, instance/container roles).

Atomicity: a single PUT (and a completed multipart upload) becomes visible whole or not at all,
so no temporary keys are needed. Endpoint and region are required: signatures depend on the
region and we never want boto3 to guess a different one than the operator meant.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import Any

from aenv.errors import AenvError, ErrorCode
from aenv.storage.repository.blobstore import BlobStoreBase, MetaInfo, check_meta_name

_MISSING = ("404", "NoSuchKey", "NotFound")


class S3BlobStore(BlobStoreBase):
    def __init__(self, endpoint: str, bucket: str, prefix: str, region: str, *,
                 max_connections: int = 32) -> None:
        import boto3
        from botocore.config import Config as BotoConfig

        if not (endpoint and bucket and region):
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            "s3 snapshot backend needs endpoint, bucket and region")
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.region = region
        # Path-style addressing works with every S3-compatible server (MinIO, Ceph, moto);
        # virtual-host style needs DNS for <bucket>.<endpoint>, which custom endpoints rarely have.
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=BotoConfig(
                max_pool_connections=max_connections,
                retries={"max_attempts": 5, "mode": "standard"},
                s3={"addressing_style": "path"},
                connect_timeout=10,
                read_timeout=60,
            ),
        )

    @property
    def description(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"

    def blob_key(self, digest: str) -> str:
        return f"{self.prefix}blobs/{digest[:2]}/{digest}"

    def _meta_key(self, name: str) -> str:
        return f"{self.prefix}meta/{check_meta_name(name)}"

    def _error(self, exc: Exception, action: str) -> AenvError:
        return AenvError(ErrorCode.UNAVAILABLE, f"snapshot repository {self.description}: {action}: {exc}")

    @staticmethod
    def _is_missing(exc: Exception) -> bool:
        from botocore.exceptions import ClientError

        return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in _MISSING

    def _head(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as exc:
            if self._is_missing(exc):
                return False
            raise self._error(exc, f"HEAD {key}") from None
        except BotoCoreError as exc:
            raise self._error(exc, f"HEAD {key}") from None

    def _put(self, key: str, body: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, f"PUT {key}") from None

    def _get(self, key: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            data: bytes = resp["Body"].read()
            return data
        except ClientError as exc:
            if self._is_missing(exc):
                return None
            raise self._error(exc, f"GET {key}") from None
        except BotoCoreError as exc:
            raise self._error(exc, f"GET {key}") from None

    def _delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, f"DELETE {key}") from None

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Contents", [])
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, f"LIST {prefix}") from None

    def _raw_has(self, digest: str) -> bool:
        return self._head(self.blob_key(digest))

    def _raw_put(self, digest: str, stored: bytes) -> None:
        self._put(self.blob_key(digest), stored)

    def _raw_get(self, digest: str) -> bytes | None:
        return self._get(self.blob_key(digest))

    def delete(self, digest: str) -> None:
        self._delete(self.blob_key(digest))

    def list(self) -> Iterator[str]:
        for obj in self._list(f"{self.prefix}blobs/"):
            yield str(obj["Key"]).rsplit("/", 1)[-1]

    def put_meta(self, name: str, data: bytes) -> None:
        self._put(self._meta_key(name), data)

    def get_meta(self, name: str) -> bytes | None:
        return self._get(self._meta_key(name))

    def list_meta(self, prefix: str) -> builtins.list[MetaInfo]:
        base = f"{self.prefix}meta/"
        out = []
        for obj in self._list(base + check_meta_name(prefix.rstrip("/")) + "/"):
            out.append(MetaInfo(str(obj["Key"])[len(base):], obj["LastModified"].timestamp()))
        return out

    def delete_meta(self, name: str) -> None:
        self._delete(self._meta_key(name))
