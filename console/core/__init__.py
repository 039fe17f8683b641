"""The console's parts that draw nothing, below its app, screens and widgets, which all import
them: the keys (bindings.py: every screen's, as textual Binding records, the only Textual here),
the chat (chat.py: the conversation, the prompt modes, the / commands), the next run
(controller.py), the figures and thresholds the panels show (figures.py, thresholds.py), and the
client of a running server (remote.py, with server_figures.py for its panels' text). They import
ds4f.api and each other, nothing of the app, the screens or the widgets, so each is tested
without a screen."""
