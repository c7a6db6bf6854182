"""The local cloud's Cloud Storage: a JSON API emulator (`python -m localcloud.storage`).

See `server` for the API surface and `store` for how buckets and objects are kept on disk.
"""
