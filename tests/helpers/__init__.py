"""What the tests share: prerequisites outside the repository (external), the kernel builds (plugin_build),
tiny models of each family, attack helpers, Python references of the ring and H2O caches, a scripted SSE
server. Imported as `helpers.<module>`: the tests folder is on sys.path through its conftest.py."""
