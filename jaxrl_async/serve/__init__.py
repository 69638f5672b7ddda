"""A policy server speaking JetStream's gRPC protocol (`jetstream_proto.Orchestrator`).

Needs the `serve` extra (grpcio, protobuf). `jetstream_pb2*.py` are generated from
`jetstream.proto` (see its header for the command).
"""
