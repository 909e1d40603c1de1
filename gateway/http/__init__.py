"""The gateway's HTTP plumbing: app assembly, auth, errors, request ids, SSE, OpenAPI, typed JSON reads."""
