package sparksteward.shim

import java.io.{File, FileNotFoundException, IOException}
import java.net.URI
import java.nio.charset.StandardCharsets.UTF_8
import java.nio.file.Files
import java.util.concurrent.TimeUnit.MILLISECONDS
import java.util.function.BiFunction

import org.apache.hadoop.conf.Configuration
import org.apache.hadoop.fs.{FSDataInputStream, FSDataOutputStream, FileStatus, FileSystem, Path}
import org.apache.hadoop.fs.permission.FsPermission
import org.apache.hadoop.util.Progressable

/** A read-only Hadoop FileSystem for `steward://<scope>/<job>/<key>/<file name>` (decision 0009). It only
 *  forwards: the agent of this JVM (the executor's, else the driver's) opens the blob, verified, through its
 *  BlobCache or BlobServer store and names a local file, which is then read with the raw local FS. Scope
 *  checks, fetching and verification all happen in the agent; where no agent runs yet (spark-submit in client
 *  mode fetches --jars before the SparkContext starts), in a one-shot `python -m sparksteward blobs get`. */
class StewardFileSystem extends FileSystem {
  private var root: URI = _
  private var timeoutMs = 300000L

  override def getScheme: String = "steward"
  override def initialize(name: URI, conf: Configuration): Unit = {
    super.initialize(name, conf)
    setConf(conf)
    root = URI.create(s"steward://${name.getAuthority}/")
    timeoutMs = conf.getLong("fs.steward.timeout-ms", timeoutMs)
  }
  override def getUri: URI = root

  /** (local path, size) of the verified blob behind `f`. */
  private def local(f: Path): (Path, Long) = {
    val url = makeQualified(f).toString
    val reply = AgentAnswer.mapper.readTree(StewardFileSystem.channel(getConf).apply(url, timeoutMs))
    if (!reply.path("ok").asBoolean(false)) {
      val code = reply.path("error").path("code").asText()
      val msg = s"spark-steward cannot open $url: ${reply.path("error").path("message").asText()} [$code]"
      throw (if (code == "BLOB_NOT_FOUND" || code == "INVALID_ID") new FileNotFoundException(msg) else new IOException(msg))
    }
    (new Path(reply.path("path").asText()), reply.path("size").asLong())
  }

  override def open(f: Path, bufferSize: Int): FSDataInputStream = {
    val raw = FileSystem.getLocal(getConf).getRawFileSystem
    raw.open(local(f)._1, bufferSize)
  }
  override def getFileStatus(f: Path): FileStatus = {
    // SparkContext checks spark.jars/spark.files before it starts plugins: the driver plugin checks
    // them itself once its agent is ready, and fails the start with the reason (StewardDriverPlugin)
    if (StewardFileSystem.driverBeforeAgent()) return new FileStatus(0L, false, 1, 0L, 0L, makeQualified(f))
    val size = local(f)._2
    new FileStatus(size, false, 1, size, 0L, makeQualified(f))
  }
  override def listStatus(f: Path): Array[FileStatus] = Array(getFileStatus(f))

  private def readOnly(f: Path) = new IOException(s"$f: steward:// is read-only; upload with st.add_jar, " +
    "st.add_file or `steward blobs put`")
  override def create(f: Path, p: FsPermission, o: Boolean, b: Int, r: Short, s: Long, pr: Progressable):
    FSDataOutputStream = throw readOnly(f)
  override def append(f: Path, b: Int, p: Progressable): FSDataOutputStream = throw readOnly(f)
  override def rename(src: Path, dst: Path): Boolean = throw readOnly(src)
  override def delete(f: Path, recursive: Boolean): Boolean = throw readOnly(f)
  override def mkdirs(f: Path, p: FsPermission): Boolean = throw readOnly(f)
  override def setWorkingDirectory(dir: Path): Unit = ()
  override def getWorkingDirectory: Path = new Path(root)
}

object StewardFileSystem {
  /** The channel lives in the system properties as a JDK type, so a FileSystem loaded by another class
   *  loader than the plugin's (Hadoop's Configuration may use another) still finds it. */
  private def key(role: String) = s"sparksteward.fs.channel.$role"

  /** Called by the plugins: requests for this JVM go to `agent` (an executor's agent wins over the driver's). */
  def register(role: String, agent: AgentProcess): Unit =
    System.getProperties.put(key(role), new BiFunction[String, java.lang.Long, String] {
      override def apply(url: String, timeoutMs: java.lang.Long): String =
        AgentAnswer.mapper.writeValueAsString(agent.call("open_file", timeoutMs, "url" -> url))
    })

  def unregister(role: String): Unit = System.getProperties.remove(key(role))

  private def registered(): Option[BiFunction[String, java.lang.Long, String]] =
    Seq("executor", "driver").map(r => System.getProperties.get(key(r))).collectFirst {
      case f: BiFunction[_, _, _] => f.asInstanceOf[BiFunction[String, java.lang.Long, String]]
    }

  /** This is the driver, its plugin is configured, and its agent is not registered yet. */
  private[shim] def driverBeforeAgent(): Boolean = registered().isEmpty && {
    val env = org.apache.spark.SparkEnv.get
    env != null && env.executorId == "driver" &&
      env.conf.get("spark.plugins", "").split(",").map(_.trim).contains(classOf[StewardPlugin].getName)
  }

  private[shim] def channel(conf: Configuration): BiFunction[String, java.lang.Long, String] =
    registered().orElse {
      // an executor fetching spark.jars/spark.files at start, before its plugin runs: start its agent now
      StewardExecutorPlugin.startEarly()
      registered()
    }.getOrElse {
      val env = org.apache.spark.SparkEnv.get
      if (env == null || env.executorId == "driver") (url, timeoutMs) => fromHa(conf, url, timeoutMs)
      else throw new IOException(s"no spark-steward agent runs in this JVM: enable the plugin ($plugin)")
    }
  private def plugin = s"spark.plugins=${classOf[StewardPlugin].getName}"
  private lazy val staging = { val d = Files.createTempDirectory("spark-steward-fetch-").toFile; d.deleteOnExit(); d }

  /** No agent runs here yet (spark-submit downloads --jars in client mode before the SparkContext starts):
   *  `steward blobs get` reads the blob from the HA store `fs.steward.ha.storage-path`, verified, into a file. */
  private def fromHa(conf: Configuration, url: String, timeoutMs: Long): String = {
    val ha = Option(conf.get("fs.steward.ha.storage-path")).filter(_.nonEmpty).getOrElse(throw new IOException(
      s"spark-steward cannot read $url: no agent runs in this JVM (spark-submit fetches --jars before the " +
      "SparkContext starts): pass --conf spark.hadoop.fs.steward.ha.storage-path=<the HA path of `steward blobs " +
      s"put`>, and enable the plugin ($plugin)"))
    val out = new File(staging, url.split('/').takeRight(2).mkString("-")) // <key>-<name>
    if (!out.isFile) {
      val python = StewardPlugin.python(new org.apache.spark.SparkConf(), "driver")
      val cmd = Seq(python, "-m", "sparksteward", "blobs", "get", url, "--ha", ha, "--out", out.getPath)
      val p = new ProcessBuilder(cmd: _*).redirectErrorStream(true).start()
      val done = p.waitFor(timeoutMs, MILLISECONDS) || { p.destroyForcibly().waitFor(); false }
      val said = if (done) new String(p.getInputStream.readAllBytes(), UTF_8).trim else s"no answer in $timeoutMs ms"
      if (!done || p.exitValue() != 0) throw new IOException(if (p.exitValue() == 2) s"spark-steward: $said" else
        s"spark-steward cannot read $url with `$python -m sparksteward blobs get` (PYSPARK_DRIVER_PYTHON or " +
        s"PYSPARK_PYTHON must name a Python with spark-steward installed): $said")
      out.deleteOnExit()
    }
    AgentAnswer.mapper.createObjectNode().put("ok", true).put("path", out.getPath).put("size", out.length()).toString
  }
}
