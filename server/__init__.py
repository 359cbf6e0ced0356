"""deltaspec.server: the aiohttp OpenAI-compatible server and the command line."""
