"""The chat layer: templates (``template``: sources, the Jinja sandbox), bounded
rendering in worker processes (``render_pool``, ``render_worker``), tokenization
that keeps user text from forging control tokens (``tokenize``) and the builder
every front end uses (``prompt.ChatPromptBuilder``).

Kept import-light (nothing imported here): the render workers import
``chat.template`` only.
"""
