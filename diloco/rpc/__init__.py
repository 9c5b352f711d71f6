"""gRPC plumbing shared by every service: status mapping, retries, servers, channels, payload streaming."""
