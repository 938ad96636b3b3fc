"""Load tests: locust users over gRPC streaming and HTTP /generate_stream, genai-perf metrics."""
