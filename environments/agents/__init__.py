"""Bring your own agent: an OpenAI-compatible endpoint in front of the rollout engine, and the
environment adapter that turns an agent program (``async def solve(client, task)``) into token-exact
episodes (docs/agents.md)."""
