"""Source test cases shared by the source, export and toolkit tests."""



from support.sources import (
    image_bytes,
)

# (width, height, mode, format) of each row's image: several sizes, modes and formats.
IMAGES = [(64, 48, "RGB", "JPEG"), (33, 70, "RGBA", "PNG"), (50, 50, "P", "PNG"), (40, 24, "CMYK", "JPEG"),
          (24, 40, "L", "JPEG"), (80, 20, "RGB", "WEBP"), (31, 17, "RGBA", "WEBP")]


CAPTIONS = [{"0": "a cat on a mat", "1": "a small cat", "2": "red cat photo"}, {"short": "sky", "long": "blue sky"},
            {}, {"0": "one caption only"}, {"a": "dog", "b": "dog", "c": "large dog"}, {"0": "tree", "1": "house"},
            {"0": "river", "1": "mountain", "2": "sunset", "3": "car"}]


def T(text, loss=0):
    return ("text", text, loss)


def I(k):  # noqa: E743
    return ("image", k)


# (row, expected elements): texts by their string, images by their position in the row's image list.
CASES = [
    ({"image": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "Compare <image> and <image>"},
                                                     {"from": "gpt", "value": "Mountains."}]},
     [T("Compare"), I(0), T("and"), I(1), T("Mountains.", 1)]),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is shown?"},
                                          {"from": "gpt", "value": "A cat."}]},
     [I(0), T("What is shown?"), T("A cat.", 1)]),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image> first <image> second"},
                                          {"from": "gpt", "value": "ok"}]},
     [I(0), T("first"), T("second"), T("ok", 1)]),
    ({"conversations": [{"from": "human", "value": " Hello there \n"}, {"from": "gpt", "value": "Hi"}]},
     [T(" Hello there \n"), T("Hi", 1)]),
    ({"image": ["c.jpg", "a.png", "b.png"], "conversations": [{"from": "human", "value": "Look: <image>"},
                                                              {"from": "gpt", "value": "Seen."}]},
     [T("Look:"), I(0), T("Seen.", 1)]),
    ({"image": "b.png", "conversations": [{"from": "system", "value": "ignored by BAGEL"},
                                          {"from": "human", "value": "<image>Describe"}, {"from": "gpt", "value": "A"},
                                          {"from": "human", "value": "More?"}, {"from": "gpt", "value": "B"}]},
     [I(0), T("Describe"), T("A", 1), T("More?"), T("B", 1)]),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image> q"}, {"from": "gpt", "value": ""},
                                          {"from": "gpt", "value": "answer"}]},
     [I(0), T("q"), T("answer", 1)]),
    ({"image": ["a.png", "c.jpg"], "conversations": [{"from": "human", "value": "<image><image>"},
                                                     {"from": "gpt", "value": "two"}]},
     [I(0), I(1), T("two", 1)]),
]


FILES = {"a.png": image_bytes(40, 30, "RGBA", "PNG", seed=1), "b.png": image_bytes(30, 60, "P", "PNG", seed=2),
         "c.jpg": image_bytes(50, 50, "RGB", "JPEG", seed=3)}
