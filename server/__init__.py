"""ds4f.server: the engine over HTTP (`ds4f serve`). See ds4f.server.app."""
