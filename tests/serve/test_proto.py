"""The committed stubs are what grpcio-tools generates from jetstream.proto, and the protocol has
JetStream's names and field numbers (what JetStream's clients put on the wire)."""

import os
import pathlib

import pytest

from jaxrl_async.serve import jetstream_pb2 as pb

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO = "jaxrl_async/serve/jetstream.proto"


def test_committed_stubs_match_the_proto(tmp_path):
  protoc = pytest.importorskip("grpc_tools.protoc")
  code = protoc.main(["grpc_tools.protoc", f"-I{REPO}", f"--python_out={tmp_path}",
                      f"--grpc_python_out={tmp_path}", os.fspath(REPO / PROTO)])
  assert code == 0
  for name in ("jetstream_pb2.py", "jetstream_pb2_grpc.py"):
    generated = (tmp_path / "jaxrl_async" / "serve" / name).read_text()
    committed = (REPO / "jaxrl_async" / "serve" / name).read_text()
    assert generated == committed, f"{name} is stale: regenerate it (see {PROTO})"


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
