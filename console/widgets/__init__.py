"""The console's widgets: the generic ones (panels' frame, plots, meters, the key bar), the
dashboard's panels, and the chat (transcript and prompt line). They draw from what they are
given and post messages; the screens lay them out."""
