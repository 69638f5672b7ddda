"""The committed stubs are what grpcio-tools generates from jetstream.proto, and the protocol has
JetStream's names and field numbers (what JetStream's clients put on the wire)."""

import os
import pathlib
import re

import pytest

from jaxrl_async.serve import jetstream_pb2 as pb

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO = "jaxrl_async/serve/jetstream.proto"
# The generator stamps its own version into the stubs, as the oldest runtime they accept; the
# committed stubs keep the oldest pyproject.toml allows, so a newer grpcio-tools differs there
# and nowhere else.
VERSION_STAMPS = (
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = <v>"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <v>"),
    (re.compile(r"(Domain\.PUBLIC,\n)(\s*\d+,\n){3}"), r"\1<v>\n"),
)


def without_version_stamps(text: str) -> str:
  for pattern, replacement in VERSION_STAMPS:
    text = pattern.sub(replacement, text)
  return text


def test_committed_stubs_match_the_proto(tmp_path):
  protoc = pytest.importorskip("grpc_tools.protoc")
  code = protoc.main(["grpc_tools.protoc", f"-I{REPO}", f"--python_out={tmp_path}",
                      f"--grpc_python_out={tmp_path}", os.fspath(REPO / PROTO)])
  assert code == 0
  for name in ("jetstream_pb2.py", "jetstream_pb2_grpc.py"):
    generated = (tmp_path / "jaxrl_async" / "serve" / name).read_text()
    committed = (REPO / "jaxrl_async" / "serve" / name).read_text()
    assert without_version_stamps(generated) == without_version_stamps(committed), (
        f"{name} is stale: regenerate it (see {PROTO})")


def test_only_the_version_stamps_are_masked():
  committed = (REPO / "jaxrl_async" / "serve" / "jetstream_pb2.py").read_text()
  bumped = committed.replace("# Protobuf Python Version: 7.35.1", "# Protobuf Python Version: 8.0.2")
  bumped = re.sub(r"(Domain\.PUBLIC,\n\s*)7,", r"\g<1>8,", bumped)
  assert bumped != committed and without_version_stamps(bumped) == without_version_stamps(committed)
  grpc_stub = (REPO / "jaxrl_async" / "serve" / "jetstream_pb2_grpc.py").read_text()
  assert without_version_stamps(grpc_stub.replace("'1.85.1'", "'1.99.0'")) == (
      without_version_stamps(grpc_stub))
  # anything else still counts
  assert without_version_stamps(committed.replace("jetstream", "jetstreams")) != (
      without_version_stamps(committed))


def _fields(message) -> dict[str, int]:
  return {field.name: field.number for field in message.DESCRIPTOR.fields}


def test_names_and_field_numbers_are_jetstreams():
  service = pb.DESCRIPTOR.services_by_name["Orchestrator"]
  assert service.full_name == "jetstream_proto.Orchestrator"
  decode = service.methods_by_name["Decode"]
  assert (decode.input_type.full_name, decode.output_type.full_name) == (
      "jetstream_proto.DecodeRequest", "jetstream_proto.DecodeResponse")
  assert decode.server_streaming and not decode.client_streaming
  assert "HealthCheck" in service.methods_by_name
  assert _fields(pb.DecodeRequest) == {"max_tokens": 4, "text_content": 5, "token_content": 6,
                                       "metadata": 7, "num_samples": 8}
  assert _fields(pb.DecodeRequest.TextContent) == {"text": 1}
  assert _fields(pb.DecodeRequest.TokenContent) == {"token_ids": 1}
  assert _fields(pb.DecodeRequest.Metadata) == {"start_time": 1}
  assert _fields(pb.DecodeResponse) == {"initial_content": 2, "stream_content": 3}
  assert _fields(pb.DecodeResponse.StreamContent) == {"samples": 1}
  assert _fields(pb.DecodeResponse.StreamContent.Sample) == {"text": 1, "token_ids": 2}
  assert _fields(pb.HealthCheckResponse) == {"is_live": 1}
