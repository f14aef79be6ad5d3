"""The chat page's files (index.html, chat.js, chat.css), installed as `meshws.web`.

This file only makes the folder a package, so an installed node (editable or not)
finds the page through `importlib.resources`; `meshws.api.page` serves it.
"""
