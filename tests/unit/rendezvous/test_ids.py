from trainpod.rendezvous import ids


def test_sanitize_keeps_ids_safe_in_keys_and_urls():
    assert ids.sanitize("alice~cifar10 run/2") == "alice-cifar10-run-2"
    assert ids.sanitize("~~") == "job"
    long = ids.sanitize("x" * 300)
    assert len(long) == ids.MAX_LENGTH and long != ids.sanitize("x" * 301)


def test_a_digest_is_the_same_for_the_same_job_only():
    assert ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"]) == ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"])
    assert ids.digest_id(["etcd-v3", "e:2379", "1:2", "cifar"]) != ids.digest_id(["etcd-v3", "e:2379", "1:3", "cifar"])
