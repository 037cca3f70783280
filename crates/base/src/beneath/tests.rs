//! Unit tests of directory handles: opens stay beneath, swaps redirect nothing, kinds are named.

use super::*;

#[test]
fn links_out_of_the_directory_are_refused_and_links_inside_followed() {
    let t = tempfile::tempdir().unwrap();
    let (inside, outside) = (t.path().join("in"), t.path().join("out"));
    std::fs::create_dir_all(inside.join("sub")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), "SECRET").unwrap();
    std::fs::write(inside.join("sub/a.txt"), "A").unwrap();
    std::os::unix::fs::symlink(outside.join("secret"), inside.join("abs")).unwrap();
    std::os::unix::fs::symlink("../out/secret", inside.join("rel")).unwrap();
    std::os::unix::fs::symlink("sub/a.txt", inside.join("ok")).unwrap();
    std::os::unix::fs::symlink("loop", inside.join("loop")).unwrap();
    let d = Dir::open(&inside).unwrap();
    let lim = crate::util::CONFIG_JSON;
    assert_eq!(d.read(Path::new("ok"), &lim).unwrap(), b"A");
    for bad in ["abs", "rel", "../out/secret", "sub/../../out/secret"] {
        let e = d.read(Path::new(bad), &lim).unwrap_err();
        assert!(e.message.contains("leads outside"), "{bad}: {}", e.message);
        assert!(!e.message.contains("SECRET"));
    }
    assert_eq!(d.link_target(Path::new("abs")).leads, Leads::Outside);
    assert_eq!(d.link_target(Path::new("rel")).leads, Leads::Outside);
    assert_eq!(d.link_target(Path::new("ok")).leads, Leads::Inside);
    assert_eq!(d.link_target(Path::new("loop")).leads, Leads::Nowhere);
    // The handle keeps naming the directory it opened after the path is swapped for a link.
    std::fs::rename(&inside, t.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(&outside, &inside).unwrap();
    assert_eq!(d.read(Path::new("sub/a.txt"), &lim).unwrap(), b"A");
    assert!(d.read(Path::new("secret"), &lim).is_err());
    d.write_atomic(Path::new("sub/b.txt"), b"B").unwrap();
    assert_eq!(std::fs::read(t.path().join("moved/sub/b.txt")).unwrap(), b"B");
    assert!(!outside.join("sub").exists());
}

#[test]
fn a_held_model_directory_reads_what_was_checked_after_a_swap() {
    let t = tempfile::tempdir().unwrap();
    let (root, outside) = (t.path().join("ws"), t.path().join("out"));
    std::fs::create_dir_all(root.join("m")).unwrap();
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("config.json"), "SECRET").unwrap();
    std::fs::write(outside.join("tokenizer.json"), "SECRET").unwrap();
    std::fs::write(root.join("m/config.json"), "CHECKED").unwrap();
    std::fs::write(root.join("blobs/t"), "BLOB").unwrap();
    // A Hugging Face cache's link into blobs/: inside the root, outside the model directory.
    std::os::unix::fs::symlink("../blobs/t", root.join("m/tokenizer.json")).unwrap();
    std::os::unix::fs::symlink(outside.join("config.json"), root.join("m/linked.json")).unwrap();
    let r = Dir::open(&root).unwrap();
    let held = HeldDir::beneath(r.open_dir(Path::new("m")).unwrap(), r.clone(), PathBuf::from("m"));
    let lim = crate::util::CONFIG_JSON;
    assert_eq!(held.read_text("config.json", &lim).unwrap(), "CHECKED");
    assert_eq!(held.read_text("tokenizer.json", &lim).unwrap(), "BLOB");
    let e = held.read_text("linked.json", &lim).unwrap_err();
    assert!(e.message.contains("leads outside") && !e.message.contains("SECRET"), "{}", e.message);
    assert_eq!(
        held.listing(),
        vec![
            ("config.json".into(), Entry::File),
            ("linked.json".into(), Entry::Link),
            ("tokenizer.json".into(), Entry::Link)
        ]
    );
    // The model directory swapped for a link to outside after the check: the held handle
    // still reads the checked directory, and the path would now read the outside one.
    std::fs::rename(root.join("m"), root.join("m.aside")).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("m")).unwrap();
    assert_eq!(std::fs::read_to_string(root.join("m/config.json")).unwrap(), "SECRET");
    assert_eq!(held.read_text("config.json", &lim).unwrap(), "CHECKED");
    assert!(held.has_file("config.json"));
    // A file swapped for a link out of the root is refused, not followed.
    std::fs::remove_file(root.join("m.aside/config.json")).unwrap();
    std::os::unix::fs::symlink(outside.join("config.json"), root.join("m.aside/config.json")).unwrap();
    let e = held.read_text("config.json", &lim).unwrap_err();
    assert!(!e.message.contains("SECRET"), "{}", e.message);
    assert!(!held.has("config.json"));
    // The blob link is now resolved beneath the root through the swapped path `m`, which leads
    // outside: refused, never read.
    assert!(held.read_text("tokenizer.json", &lim).is_err());
    // With nothing confined, a link is followed wherever it leads.
    let free = HeldDir::unconfined(Dir::open(&root.join("m.aside")).unwrap());
    assert_eq!(free.read_text("linked.json", &lim).unwrap(), "SECRET");
}

#[test]
fn new_files_and_directories_never_write_through_a_planted_link() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let (inside, outside) = (t.path().join("in"), t.path().join("out"));
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(outside.join("x"), inside.join("dangling")).unwrap();
    std::fs::write(outside.join("kept"), "KEPT").unwrap();
    std::os::unix::fs::symlink(outside.join("kept"), inside.join("planted")).unwrap();
    std::os::unix::fs::symlink(&outside, inside.join("dirlink")).unwrap();
    let d = Dir::open(&inside).unwrap();
    for name in ["dangling", "planted"] {
        assert!(d.write_new(Path::new(name), b"NEW").is_err(), "{name}");
    }
    assert!(!outside.join("x").exists());
    assert_eq!(std::fs::read_to_string(outside.join("kept")).unwrap(), "KEPT");
    assert!(d.create_dir(Path::new("dirlink")).is_err());
    assert!(d.write_new(Path::new("dirlink/y"), b"NEW").is_err());
    assert!(!outside.join("y").exists());
    d.create_dir(Path::new("private")).unwrap();
    let mode = std::fs::metadata(inside.join("private")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o077, 0, "mode {mode:o}");
    d.write_new(Path::new("private/f"), b"F").unwrap();
    assert_eq!(std::fs::read(inside.join("private/f")).unwrap(), b"F");
}
